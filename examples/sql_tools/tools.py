"""The example's tools: three plain Python functions over a SQLite database.

Keel makes each function a tool (`env.tools_file: examples/sql_tools/tools.py`): its schema
comes from the type hints and the docstring, the `state` argument is hidden from the model.
`make_state(task)` gives every episode its own in-memory copy of shop.db, so nothing one
rollout does can be seen by another; Keel closes it after the episode.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

DB = Path(__file__).resolve().parent / "shop.db"
MAX_ROWS = 20
MAX_STEPS = 2_000_000  # SQLite VM instructions per query: a runaway join is stopped, not waited for


def make_state(task) -> sqlite3.Connection:
    """A fresh in-memory copy of the shop database for one episode."""
    if not DB.exists():  # generated on first use, deterministically (make_db.py)
        import importlib.util

        spec = importlib.util.spec_from_file_location("sql_tools_make_db", DB.parent / "make_db.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.build(DB)
    source = sqlite3.connect(f"file:{DB}?mode=ro", uri=True)
    con = sqlite3.connect(":memory:")
    source.backup(con)
    source.close()
    return con


def list_tables(state) -> str:
    """List the tables of the database."""
    rows = state.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name").fetchall()
    return json.dumps([r[0] for r in rows])


def describe_table(table: str, state) -> str:
    """Show the columns of a table with their types.

    Args:
        table: the table name, e.g. customers
    """
    rows = state.execute("SELECT name, type FROM pragma_table_info(?)", (table,)).fetchall()
    if not rows:
        raise ValueError(f"no such table: {table}")
    return json.dumps([f"{name} {kind}" for name, kind in rows])


def run_sql(query: str, state) -> str:
    """Run a read-only SQL query (SELECT) and return its rows as JSON.

    Args:
        query: one SELECT statement
    """
    if not query.lstrip().lower().startswith(("select", "with")):
        raise ValueError("only SELECT queries are allowed")
    steps = [0]

    def budget() -> int:
        steps[0] += 1
        return 1 if steps[0] > MAX_STEPS // 1000 else 0  # non-zero aborts the query

    state.set_progress_handler(budget, 1000)
    try:
        rows = state.execute(query).fetchmany(MAX_ROWS + 1)
    finally:
        state.set_progress_handler(None, 1000)
    more = len(rows) > MAX_ROWS
    rows = rows[:MAX_ROWS]
    values = [r[0] if len(r) == 1 else list(r) for r in rows]
    return json.dumps(values, ensure_ascii=False) + (f" (more than {MAX_ROWS} rows; only the first {MAX_ROWS} shown)" if more else "")
