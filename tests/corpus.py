"""A corpus of ordinary SQL over tables with the types users have, for diffing pushtable's faces.

Written for pushtable (no query is taken from another project): projections, expressions and
casts, string, time and nested-type functions, NULL logic, aggregates and grouping sets,
window functions, every join kind, set operations, subqueries and CTEs, ordering and limits.
``tests/test_corpus.py`` runs each query in process, through pushtable's Flight client and
through ADBC (over stored tables on a server), and over live tables against plain DataFusion.
"""

from __future__ import annotations

from datetime import date
from decimal import Decimal

import pyarrow as pa

TS = pa.timestamp("us", tz="Asia/Tokyo")
POINT = pa.struct([("x", pa.int64()), ("tag", pa.string())])

#: Events: keys with NULLs and repeats, strings, decimals, zoned timestamps, NaN, nested.
T = pa.table(
    {
        "k": pa.array([1, 2, None, 3, 2, 5, 1, None], pa.int64()),
        "s": pa.array(["a", None, "b", "a", "ß", "", "A", "b"]),
        "c": pa.array(
            [
                Decimal("1.25"),
                None,
                Decimal("-3.50"),
                Decimal("0.00"),
                Decimal("12.75"),
                Decimal("2.50"),
                None,
                Decimal("-0.01"),
            ],
            pa.decimal128(9, 2),
        ),
        "ts": pa.array(
            [0, 3_600_000_000, None, 86_400_000_000, 90_000_000_000, 1, 7_200_000_001, None],
            TS,
        ),
        "f": pa.array([1.5, float("nan"), None, -0.0, 2.25, float("inf"), 3.0, None]),
        "b": pa.array([True, False, None, True, None, False, True, False]),
        "d": pa.array(
            [date(2026, 1, 1), None, date(2025, 12, 31), date(2026, 2, 28)] * 2, pa.date32()
        ),
        "p": pa.array(
            [
                {"x": 1, "tag": "u"},
                None,
                {"x": None, "tag": "v"},
                {"x": 4, "tag": None},
                {"x": 5, "tag": "u"},
                {"x": 1, "tag": "w"},
                None,
                {"x": 2, "tag": "v"},
            ],
            POINT,
        ),
        "l": pa.array(
            [[1, 2], None, [], [None, 3], [4], [5, 5, 6], None, [7]], pa.list_(pa.int64())
        ),
        "g": pa.array(
            ["red", None, "blue", "red", "green", None, "blue", "red"]
        ).dictionary_encode(),
    }
)

#: A dimension: keys overlapping ``t``'s (some missing, one NULL, one repeated).
U = pa.table(
    {
        "k": pa.array([1, 2, 2, 4, None, 5], pa.int32()),
        "name": pa.array(["one", "two", "deux", "four", "none", None]),
        "w": pa.array([10.0, None, 20.0, 40.0, 0.5, 50.0]),
    }
)

TABLES = {"t": T, "u": U}

QUERIES = [
    # projection, expressions, casts
    "SELECT k, s FROM t",
    "SELECT k + 1 AS k1, k * 2 - 3 AS e, -k AS neg FROM t",
    "SELECT c, c * 2 AS c2, c + 0.5 AS c3, c / 4 AS c4 FROM t",
    "SELECT c * 0 AS z, c - c AS zz FROM t",
    "SELECT CAST(k AS DOUBLE) / 3 AS third, k % 2 AS parity FROM t",
    "SELECT CAST(c AS DOUBLE) AS cd, CAST(k AS VARCHAR) AS ks FROM t",
    "SELECT CAST(s AS VARCHAR) || '!' AS bang, length(s) AS n FROM t",
    "SELECT f, f * 2 AS f2, f IS NULL AS fnull, isnan(f) AS fnan FROM t",
    "SELECT b, NOT b AS nb, b AND k > 1 AS both, b OR k IS NULL AS either FROM t",
    "SELECT d, d + INTERVAL '1 day' AS next_day FROM t",
    "SELECT ts, CAST(ts AS BIGINT) AS micros FROM t",
    "SELECT arrow_typeof(ts) AS tt, arrow_typeof(c) AS ct, arrow_typeof(g) AS gt FROM t LIMIT 1",
    "SELECT 1 AS one, 'x' AS x, NULL AS nothing, 2.5 AS half",
    # NULL logic and conditionals
    "SELECT k FROM t WHERE k IS NULL",
    "SELECT k FROM t WHERE k IS NOT DISTINCT FROM NULL",
    "SELECT k, coalesce(k, -1) AS k0, nullif(k, 2) AS n2 FROM t",
    "SELECT k, CASE WHEN k > 2 THEN 'big' WHEN k > 1 THEN 'mid' ELSE 'small' END AS size FROM t",
    "SELECT k, CASE k WHEN 1 THEN 'one' WHEN 2 THEN 'two' END AS word FROM t",
    "SELECT k FROM t WHERE k IN (1, 3)",
    "SELECT k FROM t WHERE k NOT IN (1, 3)",
    "SELECT k FROM t WHERE k NOT IN (1, NULL)",
    "SELECT k FROM t WHERE k BETWEEN 2 AND 4",
    "SELECT s FROM t WHERE s LIKE 'a%' OR s ILIKE 'A'",
    "SELECT s FROM t WHERE s IS DISTINCT FROM 'a'",
    "SELECT greatest(k, 2) AS g2, least(k, 2) AS l2 FROM t",
    "SELECT k, f FROM t WHERE f > 1",
    "SELECT k, f FROM t WHERE f = f",
    # strings
    "SELECT upper(s) AS up, lower(s) AS lo, reverse(s) AS rev FROM t",
    "SELECT s, substr(s, 1, 1) AS first, concat(s, '-', k) AS joined FROM t",
    "SELECT replace(s, 'a', 'o') AS r, trim(' ' || s || ' ') AS tr FROM t",
    "SELECT s, starts_with(s, 'a') AS sw, strpos(s, 'b') AS pos FROM t",
    "SELECT split_part('a,b,c', ',', k) AS part FROM t WHERE k BETWEEN 1 AND 3",
    "SELECT lpad(s, 3, '*') AS padded, repeat(s, 2) AS twice FROM t",
    "SELECT regexp_like(s, '^[a-z]$') AS single, regexp_replace(s, '[ab]', 'x') AS x FROM t",
    "SELECT g, upper(CAST(g AS VARCHAR)) AS up FROM t",
    "SELECT coalesce(g, arrow_cast('none', 'Dictionary(Int32, Utf8)')) AS gg FROM t",
    # time
    "SELECT ts, date_trunc('hour', ts) AS h FROM t",
    "SELECT ts, date_part('hour', ts) AS hour, extract(day FROM ts) AS day FROM t",
    "SELECT ts FROM t WHERE ts >= TIMESTAMP '1970-01-02T00:00:00+09:00'",
    "SELECT ts, ts + INTERVAL '30 minutes' AS later FROM t",
    "SELECT date_bin(INTERVAL '1 hour', ts, TIMESTAMP '1970-01-01T00:00:00Z') AS bucket FROM t",
    "SELECT to_char(d, '%Y/%m/%d') AS day, date_part('year', d) AS y FROM t",
    "SELECT d FROM t WHERE d < DATE '2026-01-15'",
    "SELECT max(ts) - min(ts) AS span FROM t",
    # nested types
    "SELECT p, p.x AS x, p['tag'] AS tag FROM t",
    "SELECT k FROM t WHERE p.x > 1",
    "SELECT l, array_length(l) AS n, cardinality(l) AS c FROM t",
    "SELECT l, l[1] AS first, array_has(l, 5) AS has5 FROM t",
    "SELECT array_append(l, 0) AS appended, array_distinct(l) AS uniq FROM t",
    "SELECT k, unnest(l) AS item FROM t",
    "SELECT named_struct('k', k, 's', s) AS row FROM t",
    "SELECT make_array(k, k + 1) AS pair FROM t",
    "SELECT CASE WHEN k > 1 THEN p ELSE named_struct('x', 0, 'tag', 'z') END AS pp FROM t",
    # aggregates
    "SELECT count(*) AS n, count(k) AS nk, count(DISTINCT k) AS dk FROM t",
    "SELECT sum(k) AS sk, avg(k) AS ak, min(k) AS mi, max(k) AS ma FROM t",
    "SELECT sum(c) AS sc, avg(c) AS ac, min(c) AS mc, max(c) AS xc FROM t",
    "SELECT min(s) AS ms, max(s) AS xs, count(DISTINCT s) AS ds FROM t",
    "SELECT min(ts) AS first, max(ts) AS last FROM t",
    "SELECT bool_and(b) AS all_b, bool_or(b) AS any_b FROM t",
    "SELECT k, count(*) AS n FROM t GROUP BY k",
    "SELECT s, sum(k) AS total, count(c) AS nc FROM t GROUP BY s",
    "SELECT g, count(*) AS n FROM t GROUP BY g",
    "SELECT k, sum(c) AS total FROM t GROUP BY k HAVING sum(c) > 0",
    "SELECT k, count(*) FILTER (WHERE b) AS true_count FROM t GROUP BY k",
    "SELECT k, array_agg(s ORDER BY s) AS ss FROM t GROUP BY k",
    "SELECT k, string_agg(s, ',' ORDER BY s) AS ss FROM t GROUP BY k",
    "SELECT date_trunc('day', ts) AS day, count(*) AS n FROM t GROUP BY date_trunc('day', ts)",
    "SELECT p.tag AS tag, count(*) AS n FROM t GROUP BY p.tag",
    "SELECT k, s, count(*) AS n FROM t GROUP BY GROUPING SETS ((k, s), (k), ())",
    "SELECT k, s, sum(c) AS total FROM t GROUP BY ROLLUP (k, s)",
    "SELECT k, b, count(*) AS n FROM t GROUP BY CUBE (k, b)",
    "SELECT k, grouping(k) AS gk, count(*) AS n FROM t GROUP BY ROLLUP (k)",
    "SELECT count(*) AS n FROM t WHERE k > 100",
    "SELECT k, median(f) AS med, stddev(k) AS sd FROM t GROUP BY k",
    "SELECT approx_distinct(s) AS ad FROM t",
    # window functions
    "SELECT k, s, row_number() OVER (ORDER BY k, s) AS rn FROM t",
    "SELECT k, rank() OVER (ORDER BY k) AS r, dense_rank() OVER (ORDER BY k) AS dr FROM t",
    "SELECT k, s, sum(k) OVER (PARTITION BY s) AS per_s FROM t",
    "SELECT k, ts, lag(k) OVER (ORDER BY ts, k) AS pr, lead(k) OVER (ORDER BY ts, k) AS nx FROM t",
    "SELECT k, sum(k) OVER (ORDER BY k ROWS BETWEEN 1 PRECEDING AND CURRENT ROW) AS run FROM t",
    "SELECT k, count(*) OVER () AS total, first_value(k) OVER (ORDER BY k) AS fv FROM t",
    "SELECT k, ntile(2) OVER (ORDER BY k) AS half FROM t",
    "SELECT c, avg(c) OVER (PARTITION BY k ORDER BY c) AS running FROM t",
    # joins
    "SELECT t.k, u.name FROM t JOIN u ON t.k = u.k",
    "SELECT t.k, u.name FROM t LEFT JOIN u ON t.k = u.k",
    "SELECT t.k, u.name FROM t RIGHT JOIN u ON t.k = u.k",
    "SELECT t.k AS tk, u.k AS uk, u.name FROM t FULL JOIN u ON t.k = u.k",
    "SELECT t.k, u.name FROM t JOIN u ON t.k = u.k AND u.w > 15",
    "SELECT t.k, u.name FROM t JOIN u ON t.k IS NOT DISTINCT FROM u.k",
    "SELECT t.k, u.k AS uk FROM t JOIN u ON t.k < u.k",
    "SELECT t.s, u.name FROM t CROSS JOIN u WHERE u.w > 30",
    "SELECT k, s FROM t WHERE EXISTS (SELECT 1 FROM u WHERE u.k = t.k)",
    "SELECT k, s FROM t WHERE NOT EXISTS (SELECT 1 FROM u WHERE u.k = t.k)",
    "SELECT k FROM t WHERE k IN (SELECT k FROM u)",
    "SELECT k FROM t WHERE k NOT IN (SELECT k FROM u WHERE k IS NOT NULL)",
    "SELECT k FROM t WHERE k NOT IN (SELECT k FROM u)",
    "SELECT t.k, u.name, u.w FROM t JOIN u USING (k)",
    "SELECT a.k, b.s FROM t a JOIN t b ON a.k = b.k",
    "SELECT t.k, count(u.name) AS names FROM t LEFT JOIN u ON t.k = u.k GROUP BY t.k",
    # set operations
    "SELECT k FROM t UNION SELECT k FROM u",
    "SELECT k FROM t UNION ALL SELECT k FROM u",
    "SELECT k FROM t INTERSECT SELECT k FROM u",
    "SELECT k FROM t EXCEPT SELECT k FROM u",
    "SELECT s FROM t UNION ALL SELECT name FROM u",
    "SELECT * FROM (SELECT k FROM u UNION ALL SELECT k FROM t) AS both_tables",
    # subqueries and CTEs
    "SELECT k, (SELECT max(w) FROM u) AS top FROM t",
    "SELECT k, (SELECT max(name) FROM u WHERE u.k = t.k) AS n FROM t",
    "SELECT k FROM t WHERE k > (SELECT avg(k) FROM u)",
    "SELECT k FROM t WHERE k = ANY (SELECT k FROM u)",
    "SELECT s, n FROM (SELECT s, count(*) AS n FROM t GROUP BY s) AS g WHERE n > 1",
    "WITH big AS (SELECT * FROM t WHERE k > 1) SELECT s, count(*) AS n FROM big GROUP BY s",
    "WITH a AS (SELECT k FROM t), b AS (SELECT k FROM a WHERE k > 1) SELECT * FROM b",
    "WITH x AS (SELECT k, s FROM t) SELECT x1.k, x2.s FROM x x1 JOIN x x2 ON x1.k = x2.k",
    # ordering, limits, distinct
    "SELECT k, s FROM t ORDER BY k NULLS FIRST, s",
    "SELECT k, s FROM t ORDER BY k DESC NULLS LAST, s DESC",
    "SELECT k FROM t ORDER BY k LIMIT 3",
    "SELECT k FROM t ORDER BY k NULLS LAST LIMIT 2 OFFSET 2",
    "SELECT DISTINCT s FROM t",
    "SELECT DISTINCT k, b FROM t",
    "SELECT c FROM t ORDER BY c",
    "SELECT ts FROM t ORDER BY ts DESC",
    "SELECT f FROM t ORDER BY f",
    "SELECT k, s FROM t ORDER BY length(s), s, k LIMIT 4",
    # VALUES and table functions
    "SELECT * FROM (VALUES (1, 'a'), (2, NULL)) AS v(n, word)",
    "SELECT * FROM generate_series(1, 4) AS g",
    "SELECT t.k, v.label FROM t JOIN (VALUES (1, 'one'), (5, 'five')) AS v(k, label) ON t.k = v.k",
]


def ordered(sql: str) -> bool:
    """Whether the query orders its output (then compared row by row, in order)."""
    return " ORDER BY " in sql.split(" FROM ", 1)[-1] and "OVER (" not in sql
