"""Database tool use (Agent World Model / AgentScaler style): a generated SQLite database per episode, reached
only through a few typed tools (never raw SQL); write tasks are judged by the final database, read tasks by the
answer and an untouched database.

An environment is a TEMPLATE (a schema: tables with typed columns, primary and foreign keys, CHECK constraints)
plus a seed: `build(template, db_seed)` fills 5-30 rows per table from `random.Random("database:T:SEED")`, the
same bytes every time. A task is {template, db_seed, kind, params, text}; the env rebuilds the database from
(template, db_seed) at reset into the episode's private tree (`self.root / "db.sqlite"`, an
`envs._sandbox.EpisodeSandbox` in mode none: no program runs there, the env executes every tool itself with the
stdlib `sqlite3`, parameterized queries only, table and column names checked against the schema).

Tools (line syntax `NAME key=value ...`, values JSON literals or bare words; or JSON function calls):
  tables                                      the schema: tables, columns, types, references, allowed values
  find table=T where={"col": value} limit=N   rows of T equal on every given column (at most 20 shown)
  get table=T id=N                            one row
  update table=T id=N values={"col": value}   change columns of one row
  insert table=T values={...}                 add a row (the database assigns its id)
  delete table=T id=N                         remove one row
  answer value=V                              ends the episode with an answer (read tasks)
  submit                                      ends the episode (write tasks: the final database is judged)
A bad table, column, type, value or a constraint violation is an `InvalidAction` naming the bad value and what
is valid. Observations are capped (20 rows, 1500 chars) and flagged truncated.

Templates and task kinds (write: the database must equal the intended change applied to a fresh copy, nothing
more; read: the answer, normalized: integers exactly, money to the cent, names case- and space-insensitively):
  shop (customers, products, orders, order_items): ship_order, restock | order_total, order_count
  library (books, members, loans): lend, return_book | open_loans, book_author
  clinic (patients, doctors, appointments): cancel_appointment, book_appointment | doctor_load, which_doctor
  hr (departments, employees): transfer, raise_salary | headcount, payroll
  warehouse (warehouses, items, stock): move_stock, set_stock | units_at, units_total
  events (venues, events, bookings): cancel_booking, add_booking | seats_booked, revenue
Splits are isolated by template: train shop, library, clinic, hr; tune warehouse; eval events.
Scripted demonstration: the `find`s a person would make to learn the ids, the change (or the answer), `submit`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
import sqlite3
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Callable, Mapping

from envs._api import (COMPLETED, ActionParser, Call, Env, EnvError, EnvSpec, InvalidAction, Observation,
                       StepResult, Task, Verdict, Verifier, source_version, Tool)
from envs._sandbox import EpisodeSandbox, SandboxedEpisodes
from envs._tools import format_keywords

DB_FILE = "db.sqlite"
DB_SEEDS = 100_000        # distinct databases per template
MAX_ROWS_SHOWN = 20
MAX_OBS_CHARS = 1500


# ----------------------------------------------------------------------------------------------
# Schemas.


@dataclasses.dataclass(frozen=True)
class Column:
  """A typed column: INTEGER, REAL or TEXT, NOT NULL; `references` a table's id, `choices` the allowed texts,
  `minimum` the least number, `date` a YYYY-MM-DD text (each also a CHECK in the schema, the backstop)."""
  name: str
  type: str
  references: str | None = None
  choices: tuple[str, ...] = ()
  minimum: int | None = None
  date: bool = False

  def ddl(self) -> str:
    out = f'"{self.name}" {self.type} NOT NULL'
    if self.references:
      out += f' REFERENCES "{self.references}"(id)'
    if self.choices:
      out += " CHECK (\"%s\" IN (%s))" % (self.name, ", ".join(f"'{c}'" for c in self.choices))
    if self.minimum is not None:
      out += f' CHECK ("{self.name}" >= {self.minimum})'
    if self.date:
      out += f" CHECK (\"{self.name}\" GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]')"
    return out

  def describe(self) -> str:
    kind = {"INTEGER": "int", "REAL": "real", "TEXT": "text"}[self.type]
    if self.references:
      return f"{self.name} int->{self.references}"
    if self.choices:
      return f"{self.name} {'|'.join(self.choices)}"
    if self.date:
      return f"{self.name} date"
    return f"{self.name} {kind}" + (f">={self.minimum}" if self.minimum is not None else "")


@dataclasses.dataclass(frozen=True)
class Table:
  name: str
  columns: tuple[Column, ...]   # besides `id INTEGER PRIMARY KEY`
  unique: tuple[str, ...] = ()  # one UNIQUE group of columns, if any

  @property
  def names(self) -> tuple[str, ...]:
    return ("id",) + tuple(c.name for c in self.columns)

  def column(self, name: str) -> Column:
    for c in self.columns:
      if c.name == name:
        return c
    if name == "id":
      return Column("id", "INTEGER")
    raise InvalidAction(f"unknown column {name[:40]!r} of {self.name}; columns are {', '.join(self.names)}")

  def ddl(self) -> str:
    parts = ["id INTEGER PRIMARY KEY"] + [c.ddl() for c in self.columns]
    if self.unique:
      parts.append("UNIQUE (%s)" % ", ".join(f'"{c}"' for c in self.unique))
    return f'CREATE TABLE "{self.name}" ({", ".join(parts)})'

  def describe(self) -> str:
    return f"{self.name}(id, {', '.join(c.describe() for c in self.columns)})"


def C(name: str, type_: str = "TEXT", **kw) -> Column:
  return Column(name, type_, **kw)


SCHEMAS: dict[str, tuple[Table, ...]] = {
    "shop": (
        Table("customers", (C("name"), C("city"))),
        Table("products", (C("name"), C("price", "REAL", minimum=0), C("stock", "INTEGER", minimum=0))),
        Table("orders", (C("customer_id", "INTEGER", references="customers"),
                         C("status", choices=("pending", "shipped", "cancelled")), C("placed", date=True))),
        Table("order_items", (C("order_id", "INTEGER", references="orders"),
                              C("product_id", "INTEGER", references="products"), C("quantity", "INTEGER", minimum=1),
                              C("unit_price", "REAL", minimum=0)))),
    "library": (
        Table("books", (C("title"), C("author"), C("year", "INTEGER", minimum=0))),
        Table("members", (C("name"), C("joined", date=True))),
        Table("loans", (C("book_id", "INTEGER", references="books"), C("member_id", "INTEGER", references="members"),
                        C("due", date=True), C("status", choices=("open", "returned"))))),
    "clinic": (
        Table("patients", (C("name"), C("born", "INTEGER", minimum=1900))),
        Table("doctors", (C("name"), C("specialty"))),
        Table("appointments", (C("patient_id", "INTEGER", references="patients"),
                               C("doctor_id", "INTEGER", references="doctors"), C("day", date=True),
                               C("status", choices=("scheduled", "done", "cancelled"))))),
    "hr": (
        Table("departments", (C("name"), C("floor", "INTEGER", minimum=0))),
        Table("employees", (C("name"), C("department_id", "INTEGER", references="departments"), C("title"),
                            C("salary", "INTEGER", minimum=0)))),
    "warehouse": (
        Table("warehouses", (C("name"), C("city"))),
        Table("items", (C("name"), C("unit"))),
        Table("stock", (C("item_id", "INTEGER", references="items"),
                        C("warehouse_id", "INTEGER", references="warehouses"), C("quantity", "INTEGER", minimum=0)),
              unique=("item_id", "warehouse_id"))),
    "events": (
        Table("venues", (C("name"), C("city"), C("capacity", "INTEGER", minimum=1))),
        Table("events", (C("name"), C("venue_id", "INTEGER", references="venues"), C("day", date=True),
                         C("price", "REAL", minimum=0))),
        Table("bookings", (C("event_id", "INTEGER", references="events"), C("guest"), C("seats", "INTEGER", minimum=1),
                           C("status", choices=("confirmed", "cancelled"))))),
}
SPLIT_TEMPLATES = {"train": ("shop", "library", "clinic", "hr"), "tune": ("warehouse",), "eval": ("events",)}


def table_of(template: str, name: Any) -> Table:
  """The table `name` of `template`'s schema; InvalidAction naming the valid ones."""
  for t in SCHEMAS[template]:
    if t.name == name:
      return t
  raise InvalidAction(f"unknown table {str(name)[:40]!r}; tables are {', '.join(t.name for t in SCHEMAS[template])}")


# ----------------------------------------------------------------------------------------------
# Seeded rows.

FIRST = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kim", "Lea", "Max", "Nia", "Omar",
         "Pia", "Raj", "Sara", "Tom", "Uma", "Vic", "Wes", "Yara", "Zoe")
LAST = ("Lee", "Diaz", "Khan", "Novak", "Okoro", "Park", "Rossi", "Silva", "Berg", "Moreau", "Ito", "Adams", "Costa",
        "Weber", "Haas", "Lund")
CITIES = ("Oslo", "Lyon", "Porto", "Graz", "Turku", "Gent", "Bonn", "Cork")
PRODUCTS = tuple(f"{a} {b}" for a in ("Blue", "Steel", "Mini", "Oak", "Smart", "Travel", "Glass", "Wool")
                 for b in ("Lamp", "Kettle", "Chair", "Mug", "Clock", "Backpack", "Scarf", "Vase"))
TITLES = tuple(f"The {a} {b}" for a in ("Silent", "Hidden", "Last", "Winter", "Broken", "Golden", "Distant", "Secret")
               for b in ("River", "Garden", "Letter", "Harbor", "Mountain", "Promise", "Island", "Window"))
SPECIALTIES = ("cardiology", "dermatology", "pediatrics", "neurology", "oncology", "radiology")
DEPARTMENTS = ("Sales", "Finance", "Legal", "Research", "Support", "Marketing", "Logistics", "Design")
JOB_TITLES = ("analyst", "engineer", "manager", "assistant", "specialist")
WAREHOUSES = ("North Hub", "South Depot", "East Yard", "West Dock", "Central", "Harbor Store")
ITEMS = ("bolts", "cables", "pallets", "gloves", "helmets", "batteries", "pipes", "valves", "filters", "hinges")
UNITS = ("box", "roll", "piece", "kg")
EVENTS = tuple(f"{a} {b}" for a in ("Jazz", "Film", "Wine", "Poetry", "Chess", "Robotics", "Salsa", "Comedy")
               for b in ("Night", "Festival", "Evening", "Workshop", "Gala", "Meetup"))
VENUES = ("Blue Hall", "Old Theater", "City Arena", "Harbor Club", "Glass House", "Park Stage")


def _people(rng: random.Random, n: int) -> list[str]:
  return [f"{a} {b}" for a, b in rng.sample([(a, b) for a in FIRST for b in LAST], n)]


def _date(rng: random.Random) -> str:
  return f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _price(rng: random.Random, low: int, high: int) -> float:
  return rng.randint(low * 100, high * 100) / 100


def _rows_shop(rng):
  customers = [dict(name=n, city=rng.choice(CITIES)) for n in _people(rng, rng.randint(6, 12))]
  products = [dict(name=n, price=_price(rng, 2, 80), stock=rng.randint(0, 40))
              for n in rng.sample(PRODUCTS, rng.randint(6, 12))]
  orders = [dict(customer_id=rng.randint(1, len(customers)),
                 status=rng.choices(("pending", "shipped", "cancelled"), (5, 4, 1))[0], placed=_date(rng))
            for _ in range(rng.randint(8, 14))]
  items = []
  for oid in range(1, len(orders) + 1):
    for pid in rng.sample(range(1, len(products) + 1), rng.randint(1, 2)):
      items.append(dict(order_id=oid, product_id=pid, quantity=rng.randint(1, 4),
                        unit_price=products[pid - 1]["price"]))
  return dict(customers=customers, products=products, orders=orders, order_items=items)


def _rows_library(rng):
  books = [dict(title=t, author=a, year=rng.randint(1950, 2023))
           for t, a in zip(rng.sample(TITLES, rng.randint(8, 14)), _people(rng, 14))]
  members = [dict(name=n, joined=_date(rng)) for n in _people(rng, rng.randint(6, 12))]
  loans = [dict(book_id=rng.randint(1, len(books)), member_id=rng.randint(1, len(members)), due=_date(rng),
                status=rng.choice(("open", "returned"))) for _ in range(rng.randint(10, 24))]
  return dict(books=books, members=members, loans=loans)


def _rows_clinic(rng):
  patients = [dict(name=n, born=rng.randint(1940, 2015)) for n in _people(rng, rng.randint(8, 14))]
  doctors = [dict(name=n, specialty=rng.choice(SPECIALTIES)) for n in _people(rng, rng.randint(5, 7))]
  appointments = [dict(patient_id=rng.randint(1, len(patients)), doctor_id=rng.randint(1, len(doctors)),
                       day=_date(rng), status=rng.choices(("scheduled", "done", "cancelled"), (5, 3, 1))[0])
                  for _ in range(rng.randint(12, 28))]
  return dict(patients=patients, doctors=doctors, appointments=appointments)


def _rows_hr(rng):
  departments = [dict(name=n, floor=rng.randint(1, 9)) for n in rng.sample(DEPARTMENTS, rng.randint(5, 7))]
  employees = [dict(name=n, department_id=rng.randint(1, len(departments)), title=rng.choice(JOB_TITLES),
                    salary=rng.randint(30, 120) * 1000) for n in _people(rng, rng.randint(10, 24))]
  return dict(departments=departments, employees=employees)


def _rows_warehouse(rng):
  warehouses = [dict(name=n, city=rng.choice(CITIES)) for n in rng.sample(WAREHOUSES, 5)]
  items = [dict(name=n, unit=rng.choice(UNITS)) for n in rng.sample(ITEMS, rng.randint(5, 6))]
  stock = [dict(item_id=i, warehouse_id=w, quantity=rng.randint(0, 60))
           for i in range(1, len(items) + 1)
           for w in sorted(rng.sample(range(1, len(warehouses) + 1), rng.randint(2, len(warehouses))))]
  return dict(warehouses=warehouses, items=items, stock=stock)


def _rows_events(rng):
  venues = [dict(name=n, city=rng.choice(CITIES), capacity=rng.randint(5, 50) * 10)
            for n in rng.sample(VENUES, rng.randint(5, 6))]
  events = [dict(name=n, venue_id=rng.randint(1, len(venues)), day=_date(rng), price=_price(rng, 5, 60))
            for n in rng.sample(EVENTS, rng.randint(5, 9))]
  bookings = [dict(event_id=rng.randint(1, len(events)), guest=g, seats=rng.randint(1, 6),
                   status=rng.choices(("confirmed", "cancelled"), (4, 1))[0])
              for g in _people(rng, rng.randint(10, 26))]
  return dict(venues=venues, events=events, bookings=bookings)


ROWS: dict[str, Callable[[random.Random], dict[str, list[dict[str, Any]]]]] = {
    "shop": _rows_shop, "library": _rows_library, "clinic": _rows_clinic, "hr": _rows_hr,
    "warehouse": _rows_warehouse, "events": _rows_events}


def _check_template(template: Any) -> str:
  if template not in SCHEMAS:
    raise EnvError(f"unknown database template {template!r}; templates are {', '.join(SCHEMAS)}")
  return template


def connect(path: str | Path = ":memory:") -> sqlite3.Connection:
  """A connection with foreign keys enforced (SQLite leaves them off by default)."""
  conn = sqlite3.connect(str(path))
  conn.execute("PRAGMA foreign_keys=ON")
  return conn


def build(template: str, db_seed: int, path: str | Path = ":memory:") -> sqlite3.Connection:
  """The database of (template, db_seed), deterministically (the same rows, the same file bytes), at `path`."""
  _check_template(template)
  rows = ROWS[template](random.Random(f"database:{template}:{db_seed}"))
  conn = connect(path)
  for table in SCHEMAS[template]:
    conn.execute(table.ddl())
    cols = [c.name for c in table.columns]
    sql = 'INSERT INTO "%s" (%s) VALUES (%s)' % (table.name, ", ".join(f'"{c}"' for c in cols),
                                                 ", ".join("?" * len(cols)))
    conn.executemany(sql, [tuple(r[c] for c in cols) for r in rows[table.name]])
  conn.commit()
  return conn


def dump(conn: sqlite3.Connection, template: str) -> dict[str, dict[int, tuple]]:
  """{table: {id: row}} of every table of the schema, in schema order: the canonical state the verifier compares."""
  out = {}
  for table in SCHEMAS[template]:
    cols = ", ".join(f'"{c}"' for c in table.names)
    out[table.name] = {r[0]: tuple(round(v, 6) if isinstance(v, float) else v for v in r)
                       for r in conn.execute(f'SELECT {cols} FROM "{table.name}" ORDER BY id')}
  return out


# ----------------------------------------------------------------------------------------------
# The operations every tool, the demos and the verifier's expected state go through (one home).


def _value(table: Table, name: str, value: Any) -> Any:
  """`value` checked against column `name` of `table`: its type, allowed texts, minimum, date form."""
  col = table.column(name)
  shown = json.dumps(value, ensure_ascii=False)[:40]
  if col.type == "INTEGER":
    ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
  elif col.type == "REAL":
    ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
  else:
    ok, want = isinstance(value, str), "a text (in quotes)"
  if not ok:
    raise InvalidAction(f"{table.name}.{name}={shown}: expected {want}")
  if col.choices and value not in col.choices:
    raise InvalidAction(f"{table.name}.{name}={shown}: not one of {', '.join(col.choices)}")
  if col.minimum is not None and value < col.minimum:
    raise InvalidAction(f"{table.name}.{name}={shown}: must be >= {col.minimum}")
  if col.date and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
    raise InvalidAction(f"{table.name}.{name}={shown}: expected a date YYYY-MM-DD")
  return value


def _object(arg: Any, what: str) -> dict[str, Any]:
  if not isinstance(arg, Mapping):
    raise InvalidAction(f"{what} must be an object of column: value, e.g. {{\"name\": \"Ann Lee\"}}")
  return dict(arg)


def select(conn: sqlite3.Connection, table: Table, where: Mapping[str, Any]) -> list[dict[str, Any]]:
  """Rows of `table` equal to `where` on every given column, by id (names checked, values bound as parameters)."""
  for k, v in where.items():
    _value(table, k, v)
  cols = ", ".join(f'"{c}"' for c in table.names)
  cond = " AND ".join(f'"{k}" = ?' for k in where) or "1"
  cur = conn.execute(f'SELECT {cols} FROM "{table.name}" WHERE {cond} ORDER BY id', tuple(where.values()))
  return [dict(zip(table.names, r)) for r in cur]


def _row(conn: sqlite3.Connection, table: Table, row_id: Any) -> dict[str, Any]:
  _value(table, "id", row_id)
  rows = select(conn, table, {"id": row_id})
  if not rows:
    raise InvalidAction(f"no row of {table.name} has id {row_id}")
  return rows[0]


def _references(conn: sqlite3.Connection, template: str, table: Table, values: Mapping[str, Any]) -> None:
  for k, v in values.items():
    ref = table.column(k).references
    if ref and not select(conn, table_of(template, ref), {"id": v}):
      raise InvalidAction(f"{table.name}.{k}={v}: no row of {ref} has id {v}")


def _write(conn: sqlite3.Connection, sql: str, params: tuple, what: str) -> sqlite3.Cursor:
  try:
    cur = conn.execute(sql, params)
  except sqlite3.IntegrityError as e:  # a UNIQUE group, or a rule the checks above missed
    conn.rollback()
    raise InvalidAction(f"{what}: {e}") from None
  conn.commit()
  return cur


def update(conn: sqlite3.Connection, template: str, table_name: Any, row_id: Any, values: Any) -> dict[str, Any]:
  """Sets `values` on row `row_id` of the table; returns the new row."""
  table = table_of(template, table_name)
  values = _object(values, "values")
  if not values:
    raise InvalidAction(f"update {table.name}: values is empty; columns are {', '.join(table.names[1:])}")
  if "id" in values:
    raise InvalidAction(f"update {table.name}: id is the row's key and cannot be changed")
  _row(conn, table, row_id)
  for k, v in values.items():
    _value(table, k, v)
  _references(conn, template, table, values)
  _write(conn, 'UPDATE "%s" SET %s WHERE id = ?' % (table.name, ", ".join(f'"{k}" = ?' for k in values)),
         (*values.values(), row_id), f"update {table.name} id={row_id}")
  return _row(conn, table, row_id)


def insert(conn: sqlite3.Connection, template: str, table_name: Any, values: Any) -> int:
  """Adds a row of `values` (every column but id); returns the id the database gave it."""
  table = table_of(template, table_name)
  values = _object(values, "values")
  if "id" in values:
    raise InvalidAction(f"insert into {table.name}: leave out id, the database assigns it")
  for k, v in values.items():
    _value(table, k, v)
  missing = [c for c in table.names[1:] if c not in values]
  if missing:
    raise InvalidAction(f"insert into {table.name}: missing {', '.join(missing)}; columns are "
                        f"{', '.join(table.names[1:])}")
  _references(conn, template, table, values)
  cur = _write(conn, 'INSERT INTO "%s" (%s) VALUES (%s)' % (
      table.name, ", ".join(f'"{k}"' for k in values), ", ".join("?" * len(values))), tuple(values.values()),
               f"insert into {table.name}")
  return int(cur.lastrowid)


def delete(conn: sqlite3.Connection, template: str, table_name: Any, row_id: Any) -> None:
  table = table_of(template, table_name)
  _row(conn, table, row_id)
  for other in SCHEMAS[template]:
    for c in other.columns:
      if c.references == table.name and select(conn, other, {c.name: row_id}):
        raise InvalidAction(f"cannot delete {table.name} id={row_id}: rows of {other.name} refer to it "
                            f"({c.name}={row_id})")
  _write(conn, f'DELETE FROM "{table.name}" WHERE id = ?', (row_id,), f"delete {table.name} id={row_id}")


def apply_ops(conn: sqlite3.Connection, template: str, ops) -> None:
  for op in ops:
    if op["op"] == "update":
      update(conn, template, op["table"], op["id"], op["values"])
    else:
      insert(conn, template, op["table"], op["values"])


# ----------------------------------------------------------------------------------------------
# Task kinds: what a task asks (drawn from its database), what solves it, how a person would look it up.


@dataclasses.dataclass(frozen=True)
class Plan:
  """What solves a task on its fresh database: `ops` (write tasks: updates {op, table, id, values} and inserts
  {op, table, values}) or `answer` (read tasks: (kind, value), kind int | money | text); `lookups`: the tool
  calls (name, arguments) a person makes first to learn the ids."""
  lookups: tuple[tuple[str, dict[str, Any]], ...]
  ops: tuple[dict[str, Any], ...] = ()
  answer: tuple[str, Any] | None = None


def _q(conn, sql: str, *params) -> list[tuple]:
  return list(conn.execute(sql, params))


def _one(conn, sql: str, *params) -> Any:
  return conn.execute(sql, params).fetchone()[0]


def _find(table: str, **where) -> tuple[str, dict[str, Any]]:
  return ("find", dict(table=table, where=where))


def _upd(table: str, row_id: int, **values) -> dict[str, Any]:
  return dict(op="update", table=table, id=row_id, values=values)


def _ins(table: str, **values) -> dict[str, Any]:
  return dict(op="insert", table=table, values=values)


def _id(conn, table: str, col: str, value: Any) -> int:
  return _one(conn, f'SELECT id FROM "{table}" WHERE "{col}" = ?', value)


def _money(value: float) -> Decimal:
  return Decimal(f"{value:.2f}")


def _unique_pairs(conn, sql: str) -> list[tuple]:
  """Rows of `sql` (id, a, b, ...) whose (a, b) occurs once: a task names the row by (a, b)."""
  rows = _q(conn, sql)
  counts: dict[tuple, int] = {}
  for r in rows:
    counts[r[1:3]] = counts.get(r[1:3], 0) + 1
  return [r for r in rows if counts[r[1:3]] == 1]


# shop
def _draw_ship_order(rng, conn):
  rows = [r for r in _unique_pairs(conn, "SELECT o.id, c.name, o.placed, o.status FROM orders o JOIN customers c "
                                         "ON c.id = o.customer_id") if r[3] == "pending"]
  return dict(customer=(r := rng.choice(rows))[1], date=r[2]) if rows else None


def _solve_ship_order(conn, p):
  cid = _id(conn, "customers", "name", p["customer"])
  oid = _one(conn, "SELECT id FROM orders WHERE customer_id = ? AND placed = ?", cid, p["date"])
  return Plan((_find("customers", name=p["customer"]), _find("orders", customer_id=cid, placed=p["date"])),
              ops=(_upd("orders", oid, status="shipped"),))


def _draw_restock(rng, conn):
  return dict(product=rng.choice(_q(conn, "SELECT name FROM products"))[0], k=rng.randint(2, 20))


def _solve_restock(conn, p):
  pid, stock = _q(conn, "SELECT id, stock FROM products WHERE name = ?", p["product"])[0]
  return Plan((_find("products", name=p["product"]),), ops=(_upd("products", pid, stock=stock + p["k"]),))


def _draw_order_total(rng, conn):
  rows = _unique_pairs(conn, "SELECT o.id, c.name, o.placed FROM orders o JOIN customers c ON c.id = o.customer_id")
  return dict(customer=(r := rng.choice(rows))[1], date=r[2]) if rows else None


def _solve_order_total(conn, p):
  cid = _id(conn, "customers", "name", p["customer"])
  oid = _one(conn, "SELECT id FROM orders WHERE customer_id = ? AND placed = ?", cid, p["date"])
  total = sum(q * _money(u) for q, u in _q(conn, "SELECT quantity, unit_price FROM order_items WHERE order_id = ?",
                                           oid))
  return Plan((_find("customers", name=p["customer"]), _find("orders", customer_id=cid, placed=p["date"]),
               _find("order_items", order_id=oid)), answer=("money", total))


def _draw_order_count(rng, conn):
  return dict(customer=rng.choice(_q(conn, "SELECT name FROM customers"))[0])


def _solve_order_count(conn, p):
  cid = _id(conn, "customers", "name", p["customer"])
  return Plan((_find("customers", name=p["customer"]), _find("orders", customer_id=cid)),
              answer=("int", _one(conn, "SELECT COUNT(*) FROM orders WHERE customer_id = ?", cid)))


# library
def _draw_lend(rng, conn):
  return dict(title=rng.choice(_q(conn, "SELECT title FROM books"))[0],
              member=rng.choice(_q(conn, "SELECT name FROM members"))[0], due=_date(rng))


def _solve_lend(conn, p):
  bid, mid = _id(conn, "books", "title", p["title"]), _id(conn, "members", "name", p["member"])
  return Plan((_find("books", title=p["title"]), _find("members", name=p["member"])),
              ops=(_ins("loans", book_id=bid, member_id=mid, due=p["due"], status="open"),))


def _draw_return_book(rng, conn):
  rows = [r for r in _unique_pairs(conn, "SELECT l.id, m.name, b.title FROM loans l JOIN members m ON m.id = "
                                         "l.member_id JOIN books b ON b.id = l.book_id WHERE l.status = 'open'")]
  return dict(member=(r := rng.choice(rows))[1], title=r[2]) if rows else None


def _solve_return_book(conn, p):
  bid, mid = _id(conn, "books", "title", p["title"]), _id(conn, "members", "name", p["member"])
  lid = _one(conn, "SELECT id FROM loans WHERE book_id = ? AND member_id = ? AND status = 'open'", bid, mid)
  return Plan((_find("members", name=p["member"]), _find("books", title=p["title"]),
               _find("loans", book_id=bid, member_id=mid, status="open")), ops=(_upd("loans", lid, status="returned"),))


def _draw_open_loans(rng, conn):
  return dict(member=rng.choice(_q(conn, "SELECT name FROM members"))[0])


def _solve_open_loans(conn, p):
  mid = _id(conn, "members", "name", p["member"])
  return Plan((_find("members", name=p["member"]), _find("loans", member_id=mid, status="open")),
              answer=("int", _one(conn, "SELECT COUNT(*) FROM loans WHERE member_id = ? AND status = 'open'", mid)))


def _draw_book_author(rng, conn):
  return dict(title=rng.choice(_q(conn, "SELECT title FROM books"))[0])


def _solve_book_author(conn, p):
  return Plan((_find("books", title=p["title"]),),
              answer=("text", _one(conn, "SELECT author FROM books WHERE title = ?", p["title"])))


# clinic
_APPOINTMENTS = "SELECT a.id, p.name, a.day, a.status FROM appointments a JOIN patients p ON p.id = a.patient_id"


def _draw_cancel_appointment(rng, conn):
  rows = [r for r in _unique_pairs(conn, _APPOINTMENTS) if r[3] == "scheduled"]
  return dict(patient=(r := rng.choice(rows))[1], day=r[2]) if rows else None


def _solve_cancel_appointment(conn, p):
  pid = _id(conn, "patients", "name", p["patient"])
  aid = _one(conn, "SELECT id FROM appointments WHERE patient_id = ? AND day = ?", pid, p["day"])
  return Plan((_find("patients", name=p["patient"]), _find("appointments", patient_id=pid, day=p["day"])),
              ops=(_upd("appointments", aid, status="cancelled"),))


def _draw_book_appointment(rng, conn):
  return dict(patient=rng.choice(_q(conn, "SELECT name FROM patients"))[0],
              doctor=rng.choice(_q(conn, "SELECT name FROM doctors"))[0], day=_date(rng))


def _solve_book_appointment(conn, p):
  pid, did = _id(conn, "patients", "name", p["patient"]), _id(conn, "doctors", "name", p["doctor"])
  return Plan((_find("patients", name=p["patient"]), _find("doctors", name=p["doctor"])),
              ops=(_ins("appointments", patient_id=pid, doctor_id=did, day=p["day"], status="scheduled"),))


def _draw_doctor_load(rng, conn):
  return dict(doctor=rng.choice(_q(conn, "SELECT name FROM doctors"))[0])


def _solve_doctor_load(conn, p):
  did = _id(conn, "doctors", "name", p["doctor"])
  return Plan((_find("doctors", name=p["doctor"]), _find("appointments", doctor_id=did, status="scheduled")),
              answer=("int", _one(conn, "SELECT COUNT(*) FROM appointments WHERE doctor_id = ? AND status = "
                                        "'scheduled'", did)))


def _draw_which_doctor(rng, conn):
  rows = _unique_pairs(conn, _APPOINTMENTS)
  return dict(patient=(r := rng.choice(rows))[1], day=r[2]) if rows else None


def _solve_which_doctor(conn, p):
  pid = _id(conn, "patients", "name", p["patient"])
  did = _one(conn, "SELECT doctor_id FROM appointments WHERE patient_id = ? AND day = ?", pid, p["day"])
  return Plan((_find("patients", name=p["patient"]), _find("appointments", patient_id=pid, day=p["day"]),
               ("get", dict(table="doctors", id=did))),
              answer=("text", _one(conn, "SELECT name FROM doctors WHERE id = ?", did)))


# hr
def _draw_transfer(rng, conn):
  name, dept = rng.choice(_q(conn, "SELECT name, department_id FROM employees"))
  others = _q(conn, "SELECT name FROM departments WHERE id != ?", dept)
  return dict(employee=name, department=rng.choice(others)[0])


def _solve_transfer(conn, p):
  eid, did = _id(conn, "employees", "name", p["employee"]), _id(conn, "departments", "name", p["department"])
  return Plan((_find("employees", name=p["employee"]), _find("departments", name=p["department"])),
              ops=(_upd("employees", eid, department_id=did),))


def _draw_raise_salary(rng, conn):
  return dict(employee=rng.choice(_q(conn, "SELECT name FROM employees"))[0], k=rng.randint(2, 20) * 500)


def _solve_raise_salary(conn, p):
  eid, salary = _q(conn, "SELECT id, salary FROM employees WHERE name = ?", p["employee"])[0]
  return Plan((_find("employees", name=p["employee"]),), ops=(_upd("employees", eid, salary=salary + p["k"]),))


def _draw_department(rng, conn):
  return dict(department=rng.choice(_q(conn, "SELECT name FROM departments"))[0])


def _solve_headcount(conn, p):
  did = _id(conn, "departments", "name", p["department"])
  return Plan((_find("departments", name=p["department"]), _find("employees", department_id=did)),
              answer=("int", _one(conn, "SELECT COUNT(*) FROM employees WHERE department_id = ?", did)))


def _solve_payroll(conn, p):
  did = _id(conn, "departments", "name", p["department"])
  return Plan((_find("departments", name=p["department"]), _find("employees", department_id=did)),
              answer=("int", _one(conn, "SELECT COALESCE(SUM(salary), 0) FROM employees WHERE department_id = ?",
                                  did)))


# warehouse
_STOCK = ("SELECT s.id, i.name, w.name, s.quantity, s.item_id, s.warehouse_id FROM stock s JOIN items i ON "
          "i.id = s.item_id JOIN warehouses w ON w.id = s.warehouse_id")


def _draw_move_stock(rng, conn):
  rows = _q(conn, _STOCK)
  sources = [r for r in rows if r[3] > 0]
  if not sources:
    return None
  src = rng.choice(sources)
  dst = rng.choice([r for r in rows if r[4] == src[4] and r[0] != src[0]])
  return dict(item=src[1], k=rng.randint(1, min(src[3], 15)), src=src[2], dst=dst[2])


def _stock_row(conn, item: str, warehouse: str) -> tuple[int, int, int, int]:
  """(stock id, quantity, item id, warehouse id)."""
  r = _q(conn, _STOCK + " WHERE i.name = ? AND w.name = ?", item, warehouse)[0]
  return r[0], r[3], r[4], r[5]


def _solve_move_stock(conn, p):
  src, dst = _stock_row(conn, p["item"], p["src"]), _stock_row(conn, p["item"], p["dst"])
  return Plan((_find("items", name=p["item"]), _find("warehouses"), _find("stock", item_id=src[2])),
              ops=(_upd("stock", src[0], quantity=src[1] - p["k"]), _upd("stock", dst[0], quantity=dst[1] + p["k"])))


def _draw_set_stock(rng, conn):
  r = rng.choice(_q(conn, _STOCK))
  return dict(item=r[1], warehouse=r[2], k=rng.choice([k for k in range(0, 61) if k != r[3]]))


def _solve_set_stock(conn, p):
  sid, _, iid, wid = _stock_row(conn, p["item"], p["warehouse"])
  return Plan((_find("items", name=p["item"]), _find("warehouses", name=p["warehouse"]),
               _find("stock", item_id=iid, warehouse_id=wid)), ops=(_upd("stock", sid, quantity=p["k"]),))


def _draw_units_at(rng, conn):
  r = rng.choice(_q(conn, _STOCK))
  return dict(item=r[1], warehouse=r[2])


def _solve_units_at(conn, p):
  _, quantity, iid, wid = _stock_row(conn, p["item"], p["warehouse"])
  return Plan((_find("items", name=p["item"]), _find("warehouses", name=p["warehouse"]),
               _find("stock", item_id=iid, warehouse_id=wid)), answer=("int", quantity))


def _draw_units_total(rng, conn):
  return dict(item=rng.choice(_q(conn, "SELECT name FROM items"))[0])


def _solve_units_total(conn, p):
  iid = _id(conn, "items", "name", p["item"])
  return Plan((_find("items", name=p["item"]), _find("stock", item_id=iid)),
              answer=("int", _one(conn, "SELECT SUM(quantity) FROM stock WHERE item_id = ?", iid)))


# events
_BOOKINGS = "SELECT b.id, b.guest, e.name, b.status FROM bookings b JOIN events e ON e.id = b.event_id"


def _draw_cancel_booking(rng, conn):
  rows = [r for r in _unique_pairs(conn, _BOOKINGS) if r[3] == "confirmed"]
  return dict(guest=(r := rng.choice(rows))[1], event=r[2]) if rows else None


def _solve_cancel_booking(conn, p):
  eid = _id(conn, "events", "name", p["event"])
  bid = _one(conn, "SELECT id FROM bookings WHERE event_id = ? AND guest = ?", eid, p["guest"])
  return Plan((_find("events", name=p["event"]), _find("bookings", event_id=eid, guest=p["guest"])),
              ops=(_upd("bookings", bid, status="cancelled"),))


def _draw_add_booking(rng, conn):
  guests = {r[0] for r in _q(conn, "SELECT guest FROM bookings")}
  return dict(guest=next(g for g in _people(rng, 20) if g not in guests), seats=rng.randint(1, 6),
              event=rng.choice(_q(conn, "SELECT name FROM events"))[0])


def _solve_add_booking(conn, p):
  eid = _id(conn, "events", "name", p["event"])
  return Plan((_find("events", name=p["event"]),),
              ops=(_ins("bookings", event_id=eid, guest=p["guest"], seats=p["seats"], status="confirmed"),))


def _draw_event(rng, conn):
  return dict(event=rng.choice(_q(conn, "SELECT name FROM events"))[0])


def _solve_seats_booked(conn, p):
  eid = _id(conn, "events", "name", p["event"])
  return Plan((_find("events", name=p["event"]), _find("bookings", event_id=eid, status="confirmed")),
              answer=("int", _one(conn, "SELECT COALESCE(SUM(seats), 0) FROM bookings WHERE event_id = ? AND "
                                        "status = 'confirmed'", eid)))


def _solve_revenue(conn, p):
  eid, price = _q(conn, "SELECT id, price FROM events WHERE name = ?", p["event"])[0]
  seats = _one(conn, "SELECT COALESCE(SUM(seats), 0) FROM bookings WHERE event_id = ? AND status = 'confirmed'", eid)
  return Plan((_find("events", name=p["event"]), _find("bookings", event_id=eid, status="confirmed")),
              answer=("money", seats * _money(price)))


@dataclasses.dataclass(frozen=True)
class Kind:
  name: str
  text: str                                                       # the task, formatted with its params
  draw: Callable[[random.Random, sqlite3.Connection], dict | None]  # params from a database (None: none fit)
  solve: Callable[[sqlite3.Connection, Mapping[str, Any]], Plan]


KINDS: dict[str, tuple[Kind, ...]] = {
    "shop": (
        Kind("ship_order", "Mark the pending order {customer} placed on {date} as shipped.", _draw_ship_order,
             _solve_ship_order),
        Kind("restock", "Add {k} units to the stock of the product {product}.", _draw_restock, _solve_restock),
        Kind("order_total", "What is the total value of the order {customer} placed on {date}?", _draw_order_total,
             _solve_order_total),
        Kind("order_count", "How many orders has the customer {customer} placed?", _draw_order_count,
             _solve_order_count)),
    "library": (
        Kind("lend", "Register a new loan of the book '{title}' to member {member}, due {due}.", _draw_lend,
             _solve_lend),
        Kind("return_book", "Member {member} returned '{title}': close that open loan.", _draw_return_book,
             _solve_return_book),
        Kind("open_loans", "How many open loans does member {member} have?", _draw_open_loans, _solve_open_loans),
        Kind("book_author", "Who is the author of the book '{title}'?", _draw_book_author, _solve_book_author)),
    "clinic": (
        Kind("cancel_appointment", "Cancel the appointment of patient {patient} on {day}.",
             _draw_cancel_appointment, _solve_cancel_appointment),
        Kind("book_appointment", "Schedule patient {patient} with doctor {doctor} on {day}.",
             _draw_book_appointment, _solve_book_appointment),
        Kind("doctor_load", "How many scheduled appointments does doctor {doctor} have?", _draw_doctor_load,
             _solve_doctor_load),
        Kind("which_doctor", "Which doctor does patient {patient} see on {day}?", _draw_which_doctor,
             _solve_which_doctor)),
    "hr": (
        Kind("transfer", "Transfer employee {employee} to the {department} department.", _draw_transfer,
             _solve_transfer),
        Kind("raise_salary", "Raise the salary of employee {employee} by {k}.", _draw_raise_salary,
             _solve_raise_salary),
        Kind("headcount", "How many employees work in the {department} department?", _draw_department,
             _solve_headcount),
        Kind("payroll", "What is the total salary of the {department} department?", _draw_department,
             _solve_payroll)),
    "warehouse": (
        Kind("move_stock", "Move {k} units of {item} from warehouse {src} to warehouse {dst}.", _draw_move_stock,
             _solve_move_stock),
        Kind("set_stock", "A count found {k} units of {item} in warehouse {warehouse}; record it.", _draw_set_stock,
             _solve_set_stock),
        Kind("units_at", "How many units of {item} are stored in warehouse {warehouse}?", _draw_units_at,
             _solve_units_at),
        Kind("units_total", "How many units of {item} are there across all warehouses?", _draw_units_total,
             _solve_units_total)),
    "events": (
        Kind("cancel_booking", "Cancel the booking of {guest} for the event {event}.", _draw_cancel_booking,
             _solve_cancel_booking),
        Kind("add_booking", "Book {seats} seats at the event {event} for the guest {guest}.", _draw_add_booking,
             _solve_add_booking),
        Kind("seats_booked", "How many confirmed seats are booked for the event {event}?", _draw_event,
             _solve_seats_booked),
        Kind("revenue", "What is the ticket revenue of the event {event} from confirmed bookings?", _draw_event,
             _solve_revenue)),
}


def _kind(template: str, name: str) -> Kind:
  for k in KINDS[_check_template(template)]:
    if k.name == name:
      return k
  raise EnvError(f"unknown task kind {name!r} of template {template}")


def plan(task: Task, conn: sqlite3.Connection | None = None) -> Plan:
  """What solves `task` on its fresh database (`conn`, else built here)."""
  p = task.payload
  conn = conn or build(p["template"], p["db_seed"])
  return _kind(p["template"], p["kind"]).solve(conn, p["params"])


# ----------------------------------------------------------------------------------------------
# Answers and verifiers.


def canonical(kind: str, value: Any) -> str:
  """The answer as a person writes it: an integer, money with two decimals, a name as stored."""
  return f"{Decimal(value):.2f}" if kind == "money" else str(value)


def _norm_text(text: str) -> str:
  return " ".join(text.split()).strip(" .'\"").casefold()


def answer_matches(kind: str, expected: Any, got: str | None) -> bool:
  """The training verifier's normalization: integers exactly (`3`, not `3.0` or `2 3 4`), money to the cent
  (`12.5`, `12.50`, `$12.50`, `1,012.50`), names case- and whitespace-insensitively."""
  if got is None:
    return False
  s = got.strip()
  if kind == "int":
    return re.fullmatch(r"[+-]?\d+", s) is not None and int(s) == int(expected)
  if kind == "money":
    s = s.removeprefix("$").replace(",", "")
    if not re.fullmatch(r"[+-]?\d+(\.\d+)?", s):
      return False
    try:
      return Decimal(s) == Decimal(expected)
    except InvalidOperation:
      return False
  return _norm_text(s) == _norm_text(str(expected))


def _read_db(path: Any, template: str) -> tuple[dict | None, list[str] | None, str | None]:
  """(dump, iterdump lines, error) of the database file at `path`, opened read-only."""
  path = Path(path)
  if not path.is_file() or path.is_symlink():
    return None, None, f"{DB_FILE} is missing"
  try:
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
      return dump(conn, template), list(conn.iterdump()), None
    finally:
      conn.close()
  except sqlite3.Error as e:
    return None, None, f"cannot read {DB_FILE}: {e}"


def diff(expected: Mapping[str, Mapping[int, tuple]], got: Mapping[str, Mapping[int, tuple]], template: str,
         limit: int = 8) -> list[str]:
  """The rows where `got` differs from `expected`, as short lines (at most `limit`, then a count)."""
  out = []
  for table in SCHEMAS[template]:
    want, have = expected[table.name], got.get(table.name, {})
    for rid in sorted(set(want) | set(have)):
      if rid not in have:
        out.append(f"{table.name} id={rid}: missing")
      elif rid not in want:
        out.append(f"{table.name} id={rid}: unexpected row {have[rid][1:]}")
      elif want[rid] != have[rid]:
        cols = [f"{c}={have[rid][i]!r} (want {want[rid][i]!r})" for i, c in enumerate(table.names)
                if want[rid][i] != have[rid][i]]
        out.append(f"{table.name} id={rid}: {', '.join(cols)}")
  return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def expected_state(task: Task) -> tuple[Plan, sqlite3.Connection]:
  """The plan of `task` and a fresh database with its ops applied (read tasks: unchanged)."""
  p = task.payload
  conn = build(p["template"], p["db_seed"])
  solution = plan(task, conn)
  apply_ops(conn, p["template"], solution.ops)
  return solution, conn


class DatabaseVerifier(Verifier):
  """Write tasks: the final database, table by table and row by row, equals a fresh copy with the intended change
  applied (a missing change, a wrong value, a deleted or extra row all fail). Read tasks: the answer matches
  (`answer_matches`) and the database is unchanged. `final`: {"db": path of the episode's file, "answer": text or
  None}."""

  version = "database-state-v1"

  def score(self, task: Task, final: Mapping[str, Any]) -> Verdict:
    template = task.payload["template"]
    solution, conn = expected_state(task)
    want = dump(conn, template)
    got, _, error = _read_db(final["db"], template)
    evidence: dict[str, Any] = dict(kind=task.payload["kind"], answer=None if final.get("answer") is None else
                                    str(final["answer"])[:64])
    if got is None:
      return Verdict(False, 0.0, dict(evidence, error=error), self.version)
    changes = diff(want, got, template)
    evidence["diff"] = changes
    passed = not changes
    if solution.answer is not None:
      kind, value = solution.answer
      evidence["expected"] = canonical(kind, value)
      passed = passed and answer_matches(kind, value, final.get("answer"))
    return Verdict(passed, 1.0 if passed else 0.0, evidence, self.version)


class StrictDatabaseVerifier(Verifier):
  """Held-out: SQLite's own dump (`iterdump`, every statement that rebuilds the file) equals the expected one,
  and a read task's answer is the canonical text exactly (`3`, `12.50`, `Ann Lee`). An independent serialization
  of the same state: the gap to the training verifier is a dump or a normalization that grew lax."""

  version = "database-strict-v1"

  def score(self, task: Task, final: Mapping[str, Any]) -> Verdict:
    solution, conn = expected_state(task)
    _, got, error = _read_db(final["db"], task.payload["template"])
    same = got is not None and got == list(conn.iterdump())
    answer = final.get("answer")
    passed = same and (solution.answer is None or answer == canonical(*solution.answer))
    return Verdict(passed, 1.0 if passed else 0.0, dict(same_dump=same, error=error), self.version)


# ----------------------------------------------------------------------------------------------
# The env.


TOOLS = (
    Tool.with_params("tables", "List the tables with their columns and types.", {}),
    Tool.with_params("find", "Rows of a table equal to every column: value in where (all rows without where).", {
        "table": ("string", "table name"), "where": ("object", "column: value filters, e.g. {\"name\": \"Ann Lee\"}"),
        "limit": ("integer", f"at most this many rows (1..{MAX_ROWS_SHOWN})")}, required=("table",)),
    Tool.with_params("get", "One row of a table by id.", {"table": ("string", "table name"),
                                                          "id": ("integer", "row id")}, required=("table", "id")),
    Tool.with_params("update", "Change columns of one row.", {
        "table": ("string", "table name"), "id": ("integer", "row id"),
        "values": ("object", "column: new value")}, required=("table", "id", "values")),
    Tool.with_params("insert", "Add a row (its id is assigned).", {
        "table": ("string", "table name"), "values": ("object", "column: value for every column but id")},
                     required=("table", "values")),
    Tool.with_params("delete", "Remove one row.", {"table": ("string", "table name"), "id": ("integer", "row id")},
                     required=("table", "id")),
    Tool.with_params("answer", "Give the answer to a question; ends the episode.",
                     {"value": (["string", "number"], "the answer")}, required=("value",), arg="value"),
    Tool.with_params("submit", "End the episode after making the requested changes.", {}),
)


def _format_rows(table: Table, rows: list[dict[str, Any]], limit: int) -> Observation:
  """`table: N rows` and one `col=value ...` line per row (the action syntax), at most `limit` rows and
  MAX_OBS_CHARS; a cut is flagged truncated with the full text's size."""
  lines = [format_keywords(r) for r in rows]
  head = f"{table.name}: {len(rows)} row{'s' if len(rows) != 1 else ''}"
  full = "\n".join([head] + lines)
  shown, size = [], len(head)
  for line in lines[:limit]:
    if size + 1 + len(line) > MAX_OBS_CHARS - 40:
      break
    shown.append(line)
    size += 1 + len(line)
  if len(shown) == len(lines):
    return Observation(full, False, len(full.encode()))
  text = "\n".join([head] + shown + [f"... {len(lines) - len(shown)} more rows not shown (narrow where)"])
  return Observation(text, True, len(full.encode()))


def _obs(text: str) -> Observation:
  return Observation(text, False, len(text.encode()))


def reset_text(task: Task) -> str:
  """The task and a one-line hint of the tables and tools (short: a byte-level policy reads it)."""
  tables = ", ".join(t.name for t in SCHEMAS[task.payload["template"]])
  return (f"{task.payload['text']}\nTables: {tables}.\n"
          "Tools: tables, find, get, update, insert, delete; answer a question, or submit after changes.")


class DatabaseEnv(SandboxedEpisodes, Env):
  name = "database"
  description = "typed tools over a generated SQLite database: find/get/update/insert/delete, then answer or submit"
  parser = ActionParser(tools=TOOLS, max_chars=256)

  def __init__(self, max_turns: int = 8, **kwargs):
    super().__init__(max_turns=max_turns, **kwargs)
    self.verifier = DatabaseVerifier()
    self.heldout_verifier = StrictDatabaseVerifier()
    self.template = ""

  @property
  def db_path(self) -> Path:
    return self.root / DB_FILE

  def _reset(self, task: Task, seed: int) -> str:
    self.close()
    p = task.payload
    self.template = _check_template(p.get("template"))
    _kind(self.template, p.get("kind"))
    # The tree is the episode's private directory; no program ever runs in it (the env runs every tool itself),
    # so no confinement is needed: mode none, whatever the worker's episode_sandbox.
    self.box = EpisodeSandbox("none", prefix="database-")
    build(self.template, int(p["db_seed"]), self.db_path).close()
    return reset_text(task)

  def _step(self, call: Call) -> StepResult:
    args = dict(call.arguments)
    if call.name in ("answer", "submit"):
      answer = None if call.name == "submit" else str(args["value"])
      verdict = self.judge(dict(db=self.db_path, answer=answer))
      text = "passed" if verdict.passed else "failed"
      return StepResult(_obs(text), {"outcome": verdict.reward}, True, COMPLETED, verdict=verdict)
    if call.name == "tables":
      return StepResult(_obs("\n".join(t.describe() for t in SCHEMAS[self.template])), {}, False, None)
    conn = connect(self.db_path)
    try:
      table = table_of(self.template, args.get("table"))
      if call.name == "find":
        limit = args.get("limit", MAX_ROWS_SHOWN)
        if not 1 <= limit <= MAX_ROWS_SHOWN:
          raise InvalidAction(f"find: limit={limit}: must be 1..{MAX_ROWS_SHOWN}")
        obs = _format_rows(table, select(conn, table, _object(args.get("where", {}), "where")), limit)
      elif call.name == "get":
        rows = select(conn, table, {"id": args["id"]})
        obs = _format_rows(table, rows, 1) if rows else _obs(f"{table.name}: no row has id {args['id']}")
      elif call.name == "update":
        row = update(conn, self.template, table.name, args["id"], args["values"])
        obs = _obs(f"updated {table.name} {format_keywords(row)}")
      elif call.name == "insert":
        row_id = insert(conn, self.template, table.name, args["values"])
        obs = _obs(f"inserted {table.name} id={row_id}")
      else:
        delete(conn, self.template, table.name, args["id"])
        obs = _obs(f"deleted {table.name} id={args['id']}")
    finally:
      conn.close()
    return StepResult(obs, {}, False, None, dict(tool=call.name, table=table.name))


# ----------------------------------------------------------------------------------------------
# Tasks, demonstrations, probes.

TASK_VERSION = source_version(DatabaseEnv)


def tasks(split: str, n: int, seed: int = 0) -> list[Task]:
  """`n` deterministic tasks of `split`: its templates in turn, each template's kinds in turn, a database seed
  drawn per task (DB_SEEDS per template) and the kind's parameters drawn from that database."""
  if split not in SPLIT_TEMPLATES:
    raise ValueError(f"split={split!r}: not one of {sorted(SPLIT_TEMPLATES)}")
  if n < 0:
    raise ValueError(f"n={n}: must be >= 0")
  rng = random.Random(f"database:tasks:{split}:{seed}")
  templates = SPLIT_TEMPLATES[split]
  out: list[Task] = []
  seen: set[str] = set()
  for _ in range(100 * n + 100):
    if len(out) == n:
      break
    template = templates[len(out) % len(templates)]
    kinds = KINDS[template]
    kind = kinds[(len(out) // len(templates)) % len(kinds)]
    db_seed = rng.randrange(DB_SEEDS)
    conn = build(template, db_seed)
    params = kind.draw(rng, conn)
    conn.close()
    if params is None:
      continue
    key = json.dumps([template, db_seed, kind.name, params], sort_keys=True)
    tid = f"db-{template}-{kind.name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    if tid in seen:
      continue
    seen.add(tid)
    out.append(Task(id=tid, split=split, version=TASK_VERSION, payload=dict(
        template=template, db_seed=db_seed, kind=kind.name, params=params, text=kind.text.format(**params))))
  if len(out) < n:
    raise RuntimeError(f"database: only {len(out)} of {n} tasks could be drawn for split {split}")
  return out


def describe(task: Task) -> str:
  return task.payload["text"]


def action(name: str, **arguments) -> str:
  """A tool call as a line action (the parser's own formatting: values quoted only when needed)."""
  return DatabaseEnv.parser.format(Call(name, "", arguments))


def _op_action(op: Mapping[str, Any]) -> str:
  if op["op"] == "update":
    return action("update", table=op["table"], id=op["id"], values=op["values"])
  return action("insert", table=op["table"], values=op["values"])


def _answer_action(kind: str, value: Any) -> str:
  return action("answer", value=int(value) if kind == "int" else canonical(kind, value))


def demo(task: Task, seed: int = 0) -> list[str]:
  """The lookups, then the change and `submit` (write tasks) or `answer` (read tasks)."""
  solution = plan(task)
  out = [action(name, **args) for name, args in solution.lookups]
  if solution.answer is not None:
    return out + [_answer_action(*solution.answer)]
  return out + [_op_action(op) for op in solution.ops] + ["submit"]


def probes(task: Task, seed: int = 0) -> dict[str, list[str]]:
  """Exploit probes: episodes that look done to a lax verifier without doing exactly the task; each scores 0.

  Write tasks: submit_unchanged (no change: passes a verifier that only checks nothing went wrong);
  extra_change (the change, plus the same values on another row, or the insert twice: passes one that checks
  only the intended rows); delete_instead (an update task's row deleted: passes one that checks the row no
  longer holds its old values; only where nothing refers to the row).
  Read tasks: several_values (the answer among wrong ones: passes one that looks for it among the values given);
  answer_after_write (the right answer after an unrelated insert: passes one that checks the answer alone);
  question_back (the question handed back as the answer)."""
  p = task.payload
  template = p["template"]
  conn = build(template, p["db_seed"])
  solution = plan(task, conn)
  if solution.answer is not None:
    kind, value = solution.answer
    if kind == "text":
      several = f"Nobody, {value}, Someone"
    elif kind == "money":
      several = " ".join(canonical(kind, Decimal(value) + d) for d in (-1, 0, 1))
    else:
      several = f"{value - 1} {value} {value + 1}"
    first = SCHEMAS[template][0]
    row = select(conn, first, {"id": 1})[0]
    return {"several_values": [action("answer", value=several)],
            "answer_after_write": [action("insert", table=first.name, values={k: v for k, v in row.items()
                                                                             if k != "id"}),
                                   _answer_action(kind, value)],
            "question_back": [action("answer", value=p["text"])]}
  out = {"submit_unchanged": ["submit"]}
  op = solution.ops[0]
  fix = [_op_action(o) for o in solution.ops]
  if op["op"] == "insert":
    out["extra_change"] = fix + [_op_action(op), "submit"]
    return out
  table = table_of(template, op["table"])
  for row in select(conn, table, {}):
    if row["id"] not in {o.get("id") for o in solution.ops} and any(row[k] != v for k, v in op["values"].items()):
      out["extra_change"] = fix + [_op_action(dict(op, id=row["id"])), "submit"]
      break
  if len(solution.ops) == 1 and not any(select(conn, other, {c.name: op["id"]}) for other in SCHEMAS[template]
                                        for c in other.columns if c.references == table.name):
    out["delete_instead"] = [action("delete", table=table.name, id=op["id"]), "submit"]
  return out


SPEC = EnvSpec(name="database", description=DatabaseEnv.description, make=DatabaseEnv, tasks=tasks, demo=demo,
               version_sources=(DatabaseEnv,), describe=describe, probes=probes)
