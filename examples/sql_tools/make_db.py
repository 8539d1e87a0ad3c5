"""Writes the example's SQLite database (shop.db) and its questions (train.jsonl, dev.jsonl).

    python examples/sql_tools/make_db.py          # rewrites all three, deterministically (seed 0)

A small shop: customers (name, city), products (name, category, price) and orders (customer,
product, quantity). Every question's answer is computed from the database with the same SQL
its gold calls run, so the gold episode answers it exactly (tests/test_tools_example.py checks
that the oracle scores EM 1.0 on every question through Keel's env).
"""

from __future__ import annotations

import json
import random
import sqlite3
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DB = HERE / "shop.db"

FIRST = ["Ada", "Ben", "Chloe", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Max", "Nia", "Oto", "Pia",
         "Quin", "Rosa", "Sam", "Tia", "Uma", "Vic", "Wen", "Yara", "Zoe", "Abe", "Bea", "Cy", "Dia", "Ed"]
LAST = ["Moreau", "Silva", "Kato", "Berg", "Novak", "Costa", "Weber", "Rossi", "Lind", "Okafor"]
CITIES = ["Lyon", "Porto", "Osaka", "Bergen", "Graz", "Leeds", "Turin", "Quito"]
PRODUCTS = [("kettle", "kitchen"), ("toaster", "kitchen"), ("blender", "kitchen"), ("skillet", "kitchen"), ("whisk", "kitchen"),
            ("tent", "outdoor"), ("lantern", "outdoor"), ("compass", "outdoor"), ("hammock", "outdoor"), ("backpack", "outdoor"),
            ("notebook", "office"), ("stapler", "office"), ("desk lamp", "office"), ("monitor", "office"), ("headset", "office"),
            ("yoga mat", "fitness"), ("dumbbell", "fitness"), ("jump rope", "fitness"), ("kettlebell", "fitness"), ("bike pump", "fitness")]


def build(path: Path = DB, seed: int = 0) -> Path:
    """Create the database at `path` (replacing it); same seed, same bytes of data."""
    rng = random.Random(seed)
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    con = sqlite3.connect(tmp)
    con.executescript("""
        CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);
        CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL, price INTEGER NOT NULL);
        CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
                             product_id INTEGER NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL);
    """)
    names = rng.sample([f"{f} {l}" for f in FIRST for l in LAST], 40)
    con.executemany("INSERT INTO customers VALUES (?, ?, ?)", [(i + 1, n, rng.choice(CITIES)) for i, n in enumerate(names)])
    prices = rng.sample(range(5, 400), len(PRODUCTS))  # distinct prices: "the most expensive" has one answer
    con.executemany("INSERT INTO products VALUES (?, ?, ?, ?)", [(i + 1, n, c, p) for i, ((n, c), p) in enumerate(zip(PRODUCTS, prices))])
    con.executemany("INSERT INTO orders VALUES (?, ?, ?, ?)",
                    [(i + 1, rng.randint(1, len(names)), rng.randint(1, len(PRODUCTS)), rng.randint(1, 5)) for i in range(240)])
    con.commit()
    con.close()
    tmp.replace(path)
    return path


def _one(con: sqlite3.Connection, sql: str):
    rows = con.execute(sql).fetchall()
    return rows[0][0] if rows else None


def _sql(query: str) -> dict:
    return {"name": "run_sql", "arguments": {"query": query}}


def questions(con: sqlite3.Connection, seed: int) -> list[dict]:
    """Every question the templates make over this database, shuffled with `seed`."""
    customers = con.execute("SELECT id, name, city FROM customers ORDER BY id").fetchall()
    products = con.execute("SELECT name, category, price FROM products ORDER BY id").fetchall()
    out = []
    for city in CITIES:
        q = f"SELECT COUNT(*) FROM customers WHERE city = '{city}'"
        out.append({"prompt": f"How many customers live in {city}?", "answer": str(_one(con, q)), "gold_calls": [[_sql(q)]], "kind": "count"})
    for name, _, price in products:
        q = f"SELECT price FROM products WHERE name = '{name}'"
        out.append({"prompt": f"What is the price of the {name}?", "answer": str(price), "gold_calls": [[_sql(q)]], "kind": "lookup"})
    for cid, name, city in customers:
        q = f"SELECT city FROM customers WHERE name = '{name}'"
        out.append({"prompt": f"Which city does {name} live in?", "answer": city, "gold_calls": [[_sql(q)]], "kind": "lookup"})
    for cid, name, _ in customers:
        # two steps: the customer's id first, then their orders by that id (carried across turns)
        q1 = f"SELECT id FROM customers WHERE name = '{name}'"
        q2 = f"SELECT COUNT(*) FROM orders WHERE customer_id = {cid}"
        out.append({"prompt": f"How many orders did {name} place?", "answer": str(_one(con, q2)), "gold_calls": [[_sql(q1)], [_sql(q2)]], "kind": "two_step"})
    for cat in sorted({c for _, c, _ in products}):
        q = f"SELECT name FROM products WHERE category = '{cat}' ORDER BY price DESC LIMIT 1"
        out.append({"prompt": f"What is the most expensive product in the {cat} category?", "answer": _one(con, q), "gold_calls": [[_sql(q)]], "kind": "argmax"})
    random.Random(seed).shuffle(out)
    for i, row in enumerate(out):
        row["id"] = f"sql-{i:03d}"
    return out


def main(out_dir: Path = HERE) -> None:
    out_dir = Path(out_dir)
    build(out_dir / "shop.db")
    con = sqlite3.connect(out_dir / "shop.db")
    rows = questions(con, seed=0)
    con.close()
    n_dev = 20
    for name, part in (("dev.jsonl", rows[:n_dev]), ("train.jsonl", rows[n_dev:])):
        (out_dir / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part))
    print(f"wrote {out_dir / 'shop.db'}, {len(rows) - n_dev} train and {n_dev} dev questions")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
