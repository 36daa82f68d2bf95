#!/usr/bin/env python3
"""make docs-check: the docs (README.md, docs/*.md) against the repository and the built binary.

Every command, flag, path and agent configuration key the docs show is checked here, so that
the docs cannot go stale without `make test` failing:

  make        every `make TARGET` names a target of the Makefile;
  pgscope     every `pgscope SUBCOMMAND ... --flag` uses a subcommand and flags that
              `pgscope SUBCOMMAND --help` lists (a flag shown alone must be one some subcommand
              lists); the commands that are safe to run here (`--help`, and
              `pgscope agent ... --check-config` without a config file) are run and must pass;
  commands    every command of a shell block is one of the kinds checked here (make, pgscope,
              cargo, a script of scripts/ or bench/, helm install of the chart) or one of the
              few listed in NOT_RUN with the reason it cannot run here;
  paths       every repository path shown (agent/..., scripts/..., tests/tests/...) exists, and
              every relative link (with its #anchor) points at a file and heading that exist;
  env         every PGSCOPE_* variable shown is read somewhere in the repository;
  agent       docs/agent.md: each TOML block passes `pgscope agent --config FILE --check-config`,
              each key of the reference table is set in one of them, the table lists exactly
              the keys of the configuration structs in agent/src/daemon/config.rs, and every
              PGSCOPE_* variable the daemon reads is named on the page.

Needs no root and changes nothing outside a temporary directory.

Usage: scripts/docs-check.py --bin PATH_TO_PGSCOPE [DOC.md ...]
"""

import argparse
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Top-level directories whose paths the docs may name; a path under one of them must exist.
REPO_DIRS = ("agent", "bpf", "symbolizer", "exporters", "tests", "helm", "scripts", "bench", "docs", ".ci")
PATH_RE = re.compile(r"(?<![\w./~$-])((?:%s)/[\w./*{}-]*)" % "|".join(re.escape(d) for d in REPO_DIRS))

# Commands a shell block may show that cannot run here, with the reason; anything else must be
# one of the kinds this script checks.
NOT_RUN = {
    "kubectl": "needs a Kubernetes cluster (the chart itself is checked by `make chart-test`)",
}
# Filters a command may be piped into.
FILTERS = {"grep", "head", "tail", "less", "jq", "sort"}

# Which TOML keys of the agent's configuration name a file that must exist for --check-config.
FILE_KEYS = {"ca_file"}


class Checker:
    def __init__(self, binary):
        self.binary = binary
        self.problems = []
        self.counts = {"make targets": 0, "pgscope commands": 0, "commands run": 0, "paths": 0, "links": 0, "TOML blocks": 0}
        self.tmp = Path(tempfile.mkdtemp(prefix="pgscope-docs-check."))
        self.targets = makefile_targets()
        self.help = {}  # subcommand ("" = top level) -> set of flags
        self.subcommands = []
        self.load_help()

    def problem(self, doc, line, message):
        self.problems.append(f"{rel(doc)}:{line}: {message}")

    # --- the binary ---------------------------------------------------------------------------

    def run(self, argv, env_extra=None):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PGSCOPE_")}
        env.update(env_extra or {})
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, cwd=self.tmp)

    def load_help(self):
        top = self.run([self.binary, "--help"])
        if top.returncode != 0:
            sys.exit(f"docs-check: `{self.binary} --help` failed ({top.returncode}): {top.stderr.strip()}")
        self.help[""] = flags_in(top.stdout)
        in_commands = False
        for line in top.stdout.splitlines():
            if line.strip() == "Commands:":
                in_commands = True
                continue
            if in_commands:
                if not line.strip():
                    break
                name = line.split()[0]
                if name != "help":
                    self.subcommands.append(name)
        if not self.subcommands:
            sys.exit(f"docs-check: `{self.binary} --help` lists no subcommands")
        for sub in self.subcommands:
            out = self.run([self.binary, sub, "--help"])
            if out.returncode != 0:
                sys.exit(f"docs-check: `pgscope {sub} --help` failed ({out.returncode}): {out.stderr.strip()}")
            self.help[sub] = flags_in(out.stdout)
        self.all_flags = set().union(*self.help.values())

    # --- one document -------------------------------------------------------------------------

    def check_doc(self, doc):
        text = doc.read_text()
        blocks, spans, links = parse_markdown(text)
        for lang, lines in blocks:
            for line, command in commands_of_block(lang, lines):
                self.check_command(doc, line, command, shell=lang in SHELL_LANGS)
            for line, content in lines:
                self.check_paths(doc, line, content)
                self.check_env(doc, line, content)
        for line, span in spans:
            self.check_span(doc, line, span)
            self.check_paths(doc, line, span)
            self.check_env(doc, line, span)
        for line, target in links:
            self.check_link(doc, line, target)
        if doc.name == "agent.md" and doc.parent.name == "docs":
            self.check_agent_config(doc, text, blocks)

    def check_span(self, doc, line, span):
        span = span.strip()
        if span.startswith("--"):
            flag = re.match(r"--([a-z][a-z0-9-]*)", span)
            if flag and flag.group(1) not in self.all_flags:
                self.problem(doc, line, f"flag `--{flag.group(1)}` is not an option of any pgscope subcommand")
            return
        for part in split_pipeline(span):
            words = part.split()
            if not words:
                continue
            if words[0] == "make":
                self.check_make(doc, line, words)
            elif "pgscope" in words:
                self.check_pgscope(doc, line, part, run=False)

    def check_command(self, doc, line, command, shell):
        if shell:
            try:
                parts = shell_commands(command)
            except ValueError as error:
                self.problem(doc, line, f"cannot parse the command `{command}`: {error}")
                return
        else:
            # A usage synopsis keeps its `|` alternatives and brackets in one command.
            parts = [command.split()]
        for words in parts:
            words = list(words)
            env = {}
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                name, value = words.pop(0).split("=", 1)
                env[name] = value
            while words and words[0] in ("sudo", "-E"):
                words.pop(0)
            if not words:
                continue
            first = words[0]
            if first == "make":
                self.check_make(doc, line, words)
            elif first == "pgscope" or first.endswith("/pgscope"):
                self.check_pgscope(doc, line, " ".join(words), run=shell, env=env, argv=words if shell else None)
            elif first == "cargo":
                self.check_cargo(doc, line, words)
            elif first == "helm":
                self.check_helm(doc, line, words)
            elif re.match(r"(\./)?(scripts|bench)/", first):
                script = ROOT / first.removeprefix("./")
                if not (script.is_file() and os.access(script, os.X_OK)):
                    self.problem(doc, line, f"`{first}` is not an executable script of the repository")
            elif first in NOT_RUN or first in FILTERS:
                pass
            elif shell:
                self.problem(
                    doc, line,
                    f"command `{first}` is not checked by docs-check: show only commands it checks "
                    "(make, pgscope, cargo, scripts/, bench/, helm install) or add it to NOT_RUN with why",
                )

    def check_make(self, doc, line, words):
        for word in words[1:]:
            if word.startswith("-") or "=" in word:
                continue
            if not re.fullmatch(r"[A-Za-z][\w.-]*", word):
                break
            self.counts["make targets"] += 1
            if word not in self.targets:
                self.problem(doc, line, f"`make {word}`: the Makefile has no target `{word}`")

    def check_pgscope(self, doc, line, command, run, env=None, argv=None):
        match = re.search(r"(?:^|\s|/)pgscope(\s+.*)?$", command)
        if not match:
            return
        self.counts["pgscope commands"] += 1
        rest = (match.group(1) or "").strip()
        sub_match = re.match(r"([a-z][a-z-]*)\b", rest)
        if sub_match:
            sub = sub_match.group(1)
            if sub not in self.subcommands:
                self.problem(doc, line, f"`pgscope {sub}`: no such subcommand (pgscope --help lists {', '.join(self.subcommands)})")
                return
            args = rest[sub_match.end():]
        else:
            sub, args = "", rest
        for flag in re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", args):
            if flag not in self.help[sub]:
                where = f"pgscope {sub}".strip()
                self.problem(doc, line, f"`{where}` has no flag `--{flag}` (not in `{where} --help`)")
        if not run or argv is None:
            return
        words = argv
        safe = "--help" in words or "--version" in words or (
            sub == "agent" and "--check-config" in words and "--config" not in words
        )
        if safe:
            self.counts["commands run"] += 1
            result = self.run([self.binary] + words[1:], env)
            if result.returncode != 0:
                self.problem(
                    doc, line,
                    f"`{command.strip()}` failed with exit code {result.returncode}: {result.stderr.strip()[:300]}",
                )

    def check_cargo(self, doc, line, words):
        packages = workspace_packages()
        package = None
        for flag, value in zip(words, words[1:]):
            if flag in ("-p", "--package"):
                package = value
                if value not in packages:
                    self.problem(doc, line, f"cargo package `{value}` is not in the workspace ({', '.join(sorted(packages))})")
            if flag == "--test" and package in packages and "*" not in value:
                if not (packages[package] / "tests" / f"{value}.rs").is_file():
                    self.problem(doc, line, f"`--test {value}`: {rel(packages[package] / 'tests')}/{value}.rs does not exist")

    def check_helm(self, doc, line, words):
        if len(words) < 4 or words[1] != "install":
            self.problem(doc, line, "only `helm install NAME ./helm/pgscope …` is checked by docs-check")
            return
        chart = ROOT / words[3].removeprefix("./")
        values = chart / "values.yaml"
        if not values.is_file():
            self.problem(doc, line, f"chart `{words[3]}` has no values.yaml")
            return
        for flag, value in zip(words, words[1:]):
            if flag == "--set":
                key = value.split("=", 1)[0]
                if not yaml_has_key(values.read_text(), key.split(".")):
                    self.problem(doc, line, f"`--set {key}`: {rel(values)} has no key `{key}`")

    def check_paths(self, doc, line, text):
        for path in PATH_RE.findall(text):
            path = path.rstrip(".,:;")
            if not path or path.endswith("/.."):
                continue
            self.counts["paths"] += 1
            if any(c in path for c in "*{"):
                pattern = re.sub(r"\{[^}]*\}", "*", path)
                if not glob.glob(str(ROOT / pattern)):
                    self.problem(doc, line, f"no file matches `{path}`")
            elif not (ROOT / path).exists():
                self.problem(doc, line, f"`{path}` does not exist in the repository")

    def check_env(self, doc, line, text):
        for name in re.findall(r"\bPGSCOPE_[A-Z0-9_]*[A-Z0-9]\b", text):
            if name not in repository_env_names():
                self.problem(doc, line, f"`{name}` is read nowhere in the repository")

    def check_link(self, doc, line, target):
        if re.match(r"[a-z]+:", target):
            return
        self.counts["links"] += 1
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            self.problem(doc, line, f"link to `{target}`: `{path}` does not exist")
            return
        if anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            self.problem(doc, line, f"link to `{target}`: {rel(file)} has no heading with anchor `#{anchor}`")

    # --- the agent's configuration reference --------------------------------------------------

    def check_agent_config(self, doc, text, blocks):
        schema = config_schema()
        table = reference_table(text)
        if not table:
            self.problem(doc, 1, "no configuration reference table (rows starting with | `section.key` |)")
            return
        table_line = min(table.values())
        for key in sorted(set(schema) - set(table)):
            self.problem(doc, table_line, f"configuration key `{key}` (agent/src/daemon/config.rs) is missing from the reference table")
        for key, line in sorted(table.items()):
            if key not in schema:
                self.problem(doc, line, f"the reference table documents `{key}`, which agent/src/daemon/config.rs does not have")
        checked = set()
        line_of_blocks = [(lines[0][0] - 1 if lines else 1, lang, lines) for lang, lines in blocks]
        for start, lang, lines in line_of_blocks:
            if lang != "toml":
                continue
            body = "\n".join(content for _, content in lines) + "\n"
            try:
                parsed = tomllib.loads(body)
            except tomllib.TOMLDecodeError as error:
                self.problem(doc, start, f"TOML block does not parse: {error}")
                continue
            for key in FILE_KEYS:
                # --check-config requires the file to exist: point it at a scratch one.
                scratch = self.tmp / f"{key}.pem"
                scratch.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
                body = re.sub(rf'(?m)^(\s*{key}\s*=\s*)"[^"]*"', rf'\g<1>"{scratch}"', body)
            self.counts["TOML blocks"] += 1
            config = self.tmp / f"block-{start}.toml"
            config.write_text(body)
            result = self.run([self.binary, "agent", "--config", str(config), "--check-config"])
            if result.returncode != 0:
                self.problem(doc, start, f"TOML block fails `pgscope agent --check-config`: {result.stderr.strip()[:300]}")
                continue
            checked |= flatten(parsed, schema)
        for key, line in sorted(table.items()):
            if key in schema and key not in checked:
                self.problem(doc, line, f"`{key}` is set in no TOML block of this page that passed --check-config")
        daemon_env = set()
        for source in (ROOT / "agent/src/daemon").rglob("*.rs"):
            daemon_env |= set(re.findall(r'"(PGSCOPE_[A-Z0-9_]+)"', source.read_text()))
        for name in sorted(daemon_env - set(re.findall(r"PGSCOPE_[A-Z0-9_]+", text))):
            self.problem(doc, 1, f"the daemon reads `{name}` (agent/src/daemon/), which this page does not name")


# --- Markdown -----------------------------------------------------------------------------------

SHELL_LANGS = {"sh", "bash", "shell", "console"}


def parse_markdown(text):
    """Fenced blocks as (lang, [(line, text)]), inline code spans and relative links as (line, text)."""
    blocks, spans, links = [], [], []
    paragraph = []  # (line, text) of the prose lines since the last blank line or fence

    def flush():
        if not paragraph:
            return
        joined = ""
        starts = []
        for number, content in paragraph:
            starts.append((len(joined), number))
            joined += content + " "

        def line_at(offset):
            return max(n for start, n in starts if start <= offset)

        for match in re.finditer(r"(`+)(.+?)\1", joined):
            spans.append((line_at(match.start()), match.group(2)))
        prose = re.sub(r"(`+)(.+?)\1", lambda m: " " * len(m.group(0)), joined)
        for match in re.finditer(r"\]\(([^)\s]+)\)", prose):
            links.append((line_at(match.start()), match.group(1)))
        paragraph.clear()

    fence = None
    for number, content in enumerate(text.splitlines(), 1):
        opening = re.match(r"^(```+)\s*([\w-]*)", content)
        if fence is None and opening:
            flush()
            fence = (opening.group(1), opening.group(2).lower(), [])
            continue
        if fence is not None:
            if content.startswith(fence[0]) and content.strip() == fence[0]:
                blocks.append((fence[1], fence[2]))
                fence = None
            else:
                fence[2].append((number, content))
            continue
        if not content.strip():
            flush()
        else:
            paragraph.append((number, content))
    flush()
    return blocks, spans, links


def commands_of_block(lang, lines):
    """The commands a code block shows, as (line, command): every line of a shell block
    (continued with a trailing backslash), and in other blocks the lines starting with `$ ` or
    `pgscope ` (a usage synopsis, continued by indented lines)."""
    commands = []
    current = None
    for number, content in lines:
        if lang in SHELL_LANGS:
            stripped = content.strip()
            if current is not None:
                current[1] += " " + stripped.rstrip("\\")
                if not stripped.endswith("\\"):
                    commands.append(tuple(current))
                    current = None
                continue
            if not stripped or stripped.startswith("#"):
                continue
            if stripped.endswith("\\"):
                current = [number, stripped.rstrip("\\")]
            else:
                commands.append((number, stripped))
        elif lang in ("", "text"):
            if content.startswith("$ "):
                commands.append((number, content[2:]))
                current = None
            elif content.startswith("pgscope "):
                current = [number, content]
                commands.append(current)
            elif current is not None and content.startswith(" ") and content.strip():
                current[1] += " " + content.strip()
            else:
                current = None
    return [(number, command) for number, command in commands]


def shell_commands(command):
    """The simple commands of a shell line, as word lists: comments dropped, cut at `|`, `||`,
    `&&` and `;`."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words = [], []
    for token in lexer:
        if token in ("|", "||", "&&", ";", "&"):
            commands.append(words)
            words = []
        else:
            words.append(token)
    commands.append(words)
    return commands


def split_pipeline(command):
    """A command line cut at `|`, `&&`, `||` and `;` — but not at the `|` of a usage synopsis
    (`(--pid … | --instance …)`, `F1,F2,…|all`)."""
    return re.split(r"\s\|\|?\s+(?!-)|&&|;", command)


def slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text):
    found = set()
    fence = False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (match := re.match(r"^#{1,6}\s+(.*)", line)):
            base = slug(match.group(1))
            name, n = base, 1
            while name in found:
                name = f"{base}-{n}"
                n += 1
            found.add(name)
    return found


def flags_in(help_text):
    return set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", help_text))


# --- The repository -----------------------------------------------------------------------------

def rel(path):
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def makefile_targets():
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.%-][A-Za-z0-9_.% -]*?)\s*:(?![=])", line)
        if match and not line.startswith("\t"):
            targets.update(match.group(1).split())
    return targets


_PACKAGES = None


def workspace_packages():
    global _PACKAGES
    if _PACKAGES is None:
        root = tomllib.loads((ROOT / "Cargo.toml").read_text())
        _PACKAGES = {}
        for member in root["workspace"]["members"]:
            manifest = tomllib.loads((ROOT / member / "Cargo.toml").read_text())
            _PACKAGES[manifest["package"]["name"]] = ROOT / member
    return _PACKAGES


_ENV = None


def repository_env_names():
    """Every PGSCOPE_* name the code, tests, scripts, chart and Makefile mention."""
    global _ENV
    if _ENV is None:
        _ENV = set()
        files = [ROOT / "Makefile", ROOT / "Dockerfile"]
        for top in ("agent", "symbolizer", "exporters", "tests", "scripts", "bench", "helm", ".ci"):
            files += [p for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in ("", ".rs", ".sh", ".py", ".yaml", ".tpl", ".txt")]
        for file in files:
            if file.is_file() and "corpus" not in file.parts:
                try:
                    _ENV |= set(re.findall(r"PGSCOPE_[A-Z0-9_]+", file.read_text(errors="replace")))
                except OSError:
                    pass
    return _ENV


def yaml_has_key(text, path):
    """Whether a block-style YAML document has the nested mapping key `path` (a.b.c): enough for
    the chart's values.yaml without a YAML library."""
    indent = -1
    lines = text.splitlines()
    start = 0
    for key in path:
        found = False
        for index in range(start, len(lines)):
            line = lines[index]
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            depth = len(line) - len(line.lstrip())
            if depth <= indent:
                break
            if re.match(rf"^\s*{re.escape(key)}\s*:", line) and (indent < 0 and depth == 0 or depth > indent):
                indent, start, found = depth, index + 1, True
                break
        if not found:
            return False
    return True


def config_schema():
    """The keys the agent's configuration accepts, from the serde structs of
    agent/src/daemon/config.rs: `section.key`, and `section.key[].field` for lists of structs."""
    source = (ROOT / "agent/src/daemon/config.rs").read_text()
    structs = {}
    for match in re.finditer(r"((?:#\[[^\]]*\]\s*|///[^\n]*\n\s*)*)pub struct (\w+)\s*\{(.*?)\n\}", source, re.S):
        attrs, name, body = match.groups()
        if "Deserialize" not in attrs:
            continue
        fields = {}
        rename = None
        for line in body.splitlines():
            line = line.strip()
            renamed = re.match(r'#\[serde\(.*rename\s*=\s*"([^"]+)"', line)
            if renamed:
                rename = renamed.group(1)
            field = re.match(r"pub (\w+)\s*:\s*(.+?),?$", line)
            if field:
                fields[rename or field.group(1)] = field.group(2)
                rename = None
        structs[name] = fields
    if "AgentConfig" not in structs:
        sys.exit("docs-check: cannot find `pub struct AgentConfig` in agent/src/daemon/config.rs")

    keys = {}

    def walk(struct, prefix):
        for key, ty in structs[struct].items():
            inner = re.fullmatch(r"(?:Option|Vec)<(\w+)>", ty)
            target = inner.group(1) if inner else ty
            list_of = ty.startswith("Vec<")
            path = f"{prefix}{key}"
            if target in structs and not list_of and prefix == "":
                walk(target, path + ".")
                continue
            keys[path] = target if target in structs else None
            if target in structs:
                walk(target, path + "[].")

    walk("AgentConfig", "")
    return keys


def reference_table(text):
    """`section.key` → line, from the rows of the page's tables whose first cell is one or more
    dotted keys in backticks."""
    table = {}
    for number, line in enumerate(text.splitlines(), 1):
        cells = line.split("|")
        if not line.startswith("|") or len(cells) < 3:
            continue
        keys = re.findall(r"`([a-z_]+\.[a-z_.\[\]]+)`", cells[1])
        if keys and re.fullmatch(r"\s*(`[a-z_]+\.[a-z_.\[\]]+`[,\s]*)+", cells[1]):
            for key in keys:
                table[key] = number
    return table


def flatten(parsed, schema):
    keys = set()
    for section, values in parsed.items():
        if not isinstance(values, dict):
            keys.add(section)
            continue
        for key, value in values.items():
            path = f"{section}.{key}"
            keys.add(path)
            if schema.get(path) and isinstance(value, list):
                for item in value:
                    if isinstance(item, dict):
                        keys |= {f"{path}[].{field}" for field in item}
    return keys


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", required=True, help="the built pgscope binary")
    parser.add_argument("docs", nargs="*", help="default: README.md and docs/*.md")
    args = parser.parse_args()
    binary = str(Path(args.bin).resolve())
    if not os.access(binary, os.X_OK):
        sys.exit(f"docs-check: `{args.bin}` is not an executable: build it first (cargo build --locked -p pgscope-agent)")
    docs = [Path(d).resolve() for d in args.docs] or [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    checker = Checker(binary)
    try:
        for doc in docs:
            checker.check_doc(doc)
    finally:
        shutil.rmtree(checker.tmp, ignore_errors=True)
    for problem in checker.problems:
        print(f"docs-check: {problem}", file=sys.stderr)
    if checker.problems:
        print(f"docs-check: {len(checker.problems)} problem(s) in {len(docs)} page(s)", file=sys.stderr)
        return 1
    counts = ", ".join(f"{n} {what}" for what, n in checker.counts.items())
    print(f"docs-check: {len(docs)} pages checked against the Makefile, the repository and {rel(binary)}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
