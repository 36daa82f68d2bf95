/*
 * The strings a PostgreSQL server shows in pg_stat_activity for the raw values pgscope reads
 * from its backends, asked of the server itself. scripts/gen-pg-names.py compiles this file
 * against one major's server headers, loads it into a throwaway cluster of that major and calls
 * its two functions; it never runs anywhere else.
 *
 * entries.h (written by the generator from the headers' enum members) is a list of
 * ENTRY(kind, C expression) lines: the compiler evaluates each expression against the headers,
 * the server names each value with the functions pg_stat_get_activity uses.
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "storage/lock.h"
#include "storage/lwlock.h"
#include "utils/array.h"
#include "utils/backend_status.h"
#include "utils/builtins.h"
#include "utils/wait_event.h"

PG_MODULE_MAGIC;

/* Index of an individual lock: lwlocknames.h defines each as &MainLWLockArray[N].lock. */
#define LWLOCK_NUMBER(lock) ((uint32) ((LWLockPadded *) (lock) - MainLWLockArray))

PG_FUNCTION_INFO_V1(pgscope_names);
PG_FUNCTION_INFO_V1(pgscope_wait_events);

/* A string field: "\N" for NULL (psql's notation), tabs and newlines never occur in names. */
static void
append_field(StringInfo buf, const char *s)
{
	appendStringInfoChar(buf, '\t');
	appendStringInfoString(buf, s ? s : "\\N");
}

/*
 * pgstat_get_wait_event(value), or "!" and the error message: from 17 on, a custom wait event
 * (classes Extension and InjectionPoint) that nobody registered is an ERROR, not a name.
 */
static void
append_wait_event(StringInfo buf, uint32 value)
{
	MemoryContext cxt = CurrentMemoryContext;
	const char *volatile name = NULL;
	char	   *volatile error = NULL;

	append_field(buf, pgstat_get_wait_event_type(value));
	PG_TRY();
	{
		name = pgstat_get_wait_event(value);
	}
	PG_CATCH();
	{
		ErrorData  *e;

		MemoryContextSwitchTo(cxt);
		e = CopyErrorData();
		FlushErrorState();
		error = psprintf("!%s", e->message);
	}
	PG_END_TRY();
	append_field(buf, error ? error : name);
}

/*
 * pg_stat_activity.state of this backend with st_state = value. There is no function that
 * names a BackendState (pg_stat_get_activity switches over it inline), so this sets the value
 * in this backend's own PgBackendStatus, as pgstat_report_activity would, and reads the view.
 */
static void
append_state(StringInfo buf, uint32 value)
{
	volatile PgBackendStatus *be = MyBEEntry;
	BackendState saved = be->st_state;
	char	   *state = NULL;
	int			ret;

	PGSTAT_BEGIN_WRITE_ACTIVITY(be);
	be->st_state = (BackendState) value;
	PGSTAT_END_WRITE_ACTIVITY(be);
	/* The view reads a per-transaction copy of the status array: make it copy again. */
	pgstat_clear_backend_activity_snapshot();
	ret = SPI_execute("SELECT state FROM pg_stat_activity WHERE pid = pg_backend_pid()", true, 0);
	if (ret == SPI_OK_SELECT && SPI_processed == 1)
		state = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);
	PGSTAT_BEGIN_WRITE_ACTIVITY(be);
	be->st_state = saved;
	PGSTAT_END_WRITE_ACTIVITY(be);
	pgstat_clear_backend_activity_snapshot();
	if (ret != SPI_OK_SELECT || SPI_processed != 1)
		elog(ERROR, "pg_stat_activity has no row for this backend (SPI code %d)", ret);
	append_field(buf, state);
}

/* One line: kind, expression, value, then what the server shows for it. */
static void
entry(StringInfo buf, const char *kind, const char *expr, uint32 value)
{
	appendStringInfo(buf, "%s\t%s\t%u", kind, expr, value);
	if (strcmp(kind, "backend_type") == 0)
		append_field(buf, GetBackendTypeDesc((BackendType) value));
	else if (strcmp(kind, "state") == 0)
		append_state(buf, value);
	else if (strcmp(kind, "wait") == 0)
		append_wait_event(buf, value);
	appendStringInfoChar(buf, '\n');
}

#define ENTRY(kind, expr) entry(&buf, #kind, #expr, (uint32) (expr))

/* pgscope_names() returns text: one line per entry of entries.h. */
Datum
pgscope_names(PG_FUNCTION_ARGS)
{
	StringInfoData buf;

	initStringInfo(&buf);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
#include "entries.h"
	SPI_finish();
	PG_RETURN_TEXT_P(cstring_to_text(buf.data));
}

/* pgscope_wait_events(int8[]) returns text: value, wait_event_type, wait_event per line. */
Datum
pgscope_wait_events(PG_FUNCTION_ARGS)
{
	ArrayType  *values = PG_GETARG_ARRAYTYPE_P(0);
	Datum	   *elems;
	bool	   *nulls;
	int			n;
	StringInfoData buf;

	deconstruct_array(values, INT8OID, 8, FLOAT8PASSBYVAL, 'd', &elems, &nulls, &n);
	initStringInfo(&buf);
	for (int i = 0; i < n; i++)
	{
		uint32		value = (uint32) DatumGetInt64(elems[i]);

		appendStringInfo(&buf, "%u", value);
		append_wait_event(&buf, value);
		appendStringInfoChar(&buf, '\n');
	}
	PG_RETURN_TEXT_P(cstring_to_text(buf.data));
}
