"""Store mutants: the reference store with one defect that lives in a sequence of calls or in a
pair of names (the DP-STORE-* clauses, test_store_machine.py). Each is a defect a store written
the obvious way has (a SQL table, a key/value server, a file tree), and each passes every
single-call transport clause.
"""

from __future__ import annotations

import posixpath
import re
import unicodedata

import torch

from rlconform.reference_impl.dataplane import (
    InMemoryDataPlane,
    check_name,
    check_names,
    column_layout,
    join_rows,
)
from rlconform.reference_impl.objects import ObjectColumn

from . import mutant
from .transport import _rows_in, _served_with_client, _with


# -- rules: a re-put, a clear, a get naming a key twice, refused calls, clients ------------------
@mutant("reput_keeps_old_value", "a put of a stored key kept the rows it already held (INSERT OR "
        "IGNORE per key and field): new fields are added, a new value of a stored field is "
        "dropped", "transport")
def _reput_keeps():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            part = self._rows.get(partition, {})
            held = {k: dict(part[k]) for k in keys if isinstance(k, str) and k in part}
            super().put(partition, keys, columns, tags)
            for k, fields in held.items():
                self._rows[partition][k].update(fields)

    return _with(T)()


@mutant("cleared_values_come_back", "clear of keys removed them from the key index and tags but "
        "left their rows: a later put of the same key brings the cleared fields back",
        "transport")
def _ghosts():
    class T(InMemoryDataPlane):
        def clear(self, partition, keys=None):
            part = self._rows.get(partition, {})
            kept = {k: part[k] for k in keys or () if isinstance(k, str) and k in part}
            super().clear(partition, keys)
            if keys is not None:
                self.__dict__.setdefault("_ghosts", {}).setdefault(partition, {}).update(kept)

        def put(self, partition, keys, columns, tags=None):
            super().put(partition, keys, columns, tags)
            ghosts = self.__dict__.get("_ghosts", {}).get(partition, {})
            for k in keys:
                for name, row in ghosts.pop(k, {}).items():
                    self._rows[partition][k].setdefault(name, row)

    return _with(T)()


@mutant("repeated_key_returns_one_row", "get looked keys up as a set (SQL `WHERE key IN (...)`): "
        "a key named twice comes back once, and the result is shorter than the keys asked",
        "transport")
def _dedup_get():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            return super().get(partition, list(dict.fromkeys(keys)), select_fields)

    return _with(T)()


@mutant("repeated_key_rows_share_tags", "get fetched each distinct key once and repeated the "
        "fetched rows for a key named twice: the two rows are one tag dict and one object row",
        "transport")
def _shared_rows():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            once = list(dict.fromkeys(keys))
            cols, tags = super().get(partition, once, select_fields)
            idx = [once.index(k) for k in keys]
            out = {n: ObjectColumn.adopt([c.rows[i] for i in idx]) if isinstance(c, ObjectColumn)
                   else _rows_in(c, idx) for n, c in cols.items()}
            return out, [tags[i] for i in idx]

    return _with(T)()


@mutant("repeated_key_rows_share_tensors", "get decoded each distinct key once and gave a key "
        "named twice fresh tag dicts and object rows around the first row's tensors: the two "
        "rows hold one memory, and a stage that writes one row's pixels writes its repeat's",
        "transport")
def _shared_tensors():
    def containers_copied(x):  # dicts, lists and tuples new; the tensors in them the same
        if isinstance(x, dict):
            return {k: containers_copied(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(containers_copied(v) for v in x)
        return x

    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            once = list(dict.fromkeys(keys))
            cols, tags = super().get(partition, once, select_fields)
            idx = [once.index(k) for k in keys]
            out = {n: ObjectColumn.adopt([containers_copied(c.rows[i]) for i in idx])
                   if isinstance(c, ObjectColumn) else _rows_in(c, idx) for n, c in cols.items()}
            return out, [containers_copied(tags[i]) for i in idx]

    return _with(T)()


@mutant("clear_removes_held_keys_before_raising", "clear of keys removed the keys it held and "
        "only then raised KeyError for the ones it did not: a refused clear is half done",
        "transport")
def _half_clear():
    class T(InMemoryDataPlane):
        def clear(self, partition, keys=None):
            if keys is not None:
                keys = check_names("key", keys)
                held = [k for k in keys if k in self._rows.get(partition, {})]
                if len(held) < len(keys):
                    super().clear(partition, held)
            super().clear(partition, keys)

    return _with(T)()


@mutant("list_of_unknown_partition_raises", "list of a partition holding no keys raised KeyError "
        "when the partition was never written or was cleared (the contract lists [])",
        "transport")
def _list_raises():
    class T(InMemoryDataPlane):
        def list(self, partition):
            check_name("partition", partition)
            if partition not in self._rows:
                raise KeyError(f"partition {partition!r} does not exist")
            return super().list(partition)

    return _with(T)()


@mutant("half_failed_put_keeps_first_columns", "put checked every layout first, then wrote "
        "column by column and checked each column's row count as it came to it: a later column "
        "with the wrong row count leaves the first columns stored", "transport")
def _half_put():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            keys = check_names("key", keys)
            stored = self._layouts.get(partition, {})
            for name, col in columns.items():  # the schema check, before anything is written
                if not isinstance(col, ObjectColumn):
                    layout = column_layout(check_name("field", name), col)
                    if stored.get(name, layout) != layout:
                        raise ValueError(f"column {name!r} was written in another layout")
            for name, col in columns.items():
                super().put(partition, keys, {name: col})
            super().put(partition, keys, {}, tags)

    return _with(T)()


@mutant("clear_checks_names_as_it_deletes", "clear of keys checked each name as it deleted it: "
        "a refused name after valid ones leaves those deleted", "transport")
def _clear_checks_late():
    class T(InMemoryDataPlane):
        def clear(self, partition, keys=None):
            if keys is None:
                return super().clear(partition)
            check_name("partition", partition)
            held = self._rows.get(partition, {})
            missing = [k for k in keys if isinstance(k, str) and k and k not in held]
            if missing:
                raise KeyError(f"cannot clear keys {missing}: not in partition {partition!r}")
            for k in keys:
                super().clear(partition, [check_name("key", k)])

    return _with(T)()


@mutant("client_caches_key_index", "a reopened client answered list from the key index it read "
        "first, updated only by its own puts and clears: keys another client put later are "
        "missing", "transport")
def _cached_index():
    from rlconform.reference_impl.served import StoreClient

    class C(StoreClient):
        def list(self, partition):
            cache = self.__dict__.setdefault("_index", {})
            if partition not in cache:
                cache[partition] = super().list(partition)
            return list(cache[partition])

        def put(self, partition, keys, columns, tags=None):
            super().put(partition, keys, columns, tags)
            index = self.__dict__.get("_index", {})
            if partition in index:
                index[partition] += [k for k in keys if k not in index[partition]]

        def clear(self, partition, keys=None):
            super().clear(partition, keys)
            index = self.__dict__.get("_index", {})
            if keys is None:
                index.pop(partition, None)
            elif partition in index:
                index[partition] = [k for k in index[partition] if k not in keys]

    return _served_with_client(C)


@mutant("client_close_clears_its_writes", "closing a reopened client cleared the partitions it "
        "had written (clean-up meant for a client that owns its namespace): the store loses "
        "what every other client reads", "transport")
def _close_clears():
    from rlconform.reference_impl.served import StoreClient

    class C(StoreClient):
        def put(self, partition, keys, columns, tags=None):
            self.__dict__.setdefault("_wrote", set()).add(partition)
            super().put(partition, keys, columns, tags)

        def close(self):
            for partition in self.__dict__.get("_wrote", ()):
                try:
                    self.clear(partition)
                except Exception:  # noqa: BLE001 - best effort, as such clean-up is written
                    pass
            super().close()

    return _served_with_client(C)


# -- values: zero-size dims, views ----------------------------------------------------------------
@mutant("zero_size_dims_dropped", "get rebuilt a dense column from its bytes and a shape without "
        "its zero-size dims: (n, 0, 3) comes back (n, 3)", "transport")
def _zero_dims():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            cols, tags = super().get(partition, keys, select_fields)
            out = {}
            for n, c in cols.items():
                if isinstance(c, torch.Tensor) and not c.is_nested and 0 in c.shape[1:]:
                    c = c.reshape(c.shape[0], *[d for d in c.shape[1:] if d])
                out[n] = c
            return out, tags

    return _with(T)()


@mutant("views_read_from_storage", "put serialised a dense column from its storage, from the "
        "first byte, in row-major order: a view with a storage offset, strides or a repeated "
        "row stores other values", "transport")
def _storage_bytes():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            out = {}
            for n, c in columns.items():
                if isinstance(c, torch.Tensor) and not c.is_nested and c.dim() and \
                        (not c.is_contiguous() or c.storage_offset()):
                    c = torch.empty(0, dtype=c.dtype).set_(c.untyped_storage(), 0, c.shape)
                out[n] = c
            super().put(partition, keys, out, tags)

    return _with(T)()


# -- names: one defect per name class (fixtures/names.py) --------------------------------------
class _KeyAlias(InMemoryDataPlane):
    """The reference storing each key under `alias(key)`; list shows the spelling first put."""

    def alias(self, key: str) -> str:
        return key

    def _a(self, keys):
        return [self.alias(k) if isinstance(k, str) and k else k for k in keys]

    def _spelling(self, partition) -> dict:
        return self.__dict__.setdefault("_spell", {}).setdefault(partition, {})

    def put(self, partition, keys, columns, tags=None):
        super().put(partition, self._a(keys), columns, tags)
        for k in keys:
            self._spelling(partition).setdefault(self.alias(k), k)

    def get(self, partition, keys, select_fields=None):
        return super().get(partition, self._a(keys), select_fields)

    def list(self, partition):
        spell = self._spelling(partition) if isinstance(partition, str) else {}
        return [spell.get(k, k) for k in super().list(partition)]

    def clear(self, partition, keys=None):
        super().clear(partition, None if keys is None else self._a(keys))
        spell = self._spelling(partition)
        for k in (list(spell) if keys is None else self._a(keys)):
            spell.pop(k, None)


def _key_alias(fn):
    class T(_KeyAlias):
        def alias(self, key):
            return fn(key)

    return _with(T)()


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


@mutant("key_lookup_case_insensitive", "keys were compared case-insensitively in ASCII (SQLite's "
        "NOCASE collation): 'k' and 'K' are one row", "transport")
def _keys_case():
    return _key_alias(lambda k: k.translate(_ASCII_LOWER))


@mutant("keys_split_into_stem_and_index", "rows were kept by (stem, sample index) parsed from "
        "the key's trailing digits, no digits read as index 0 (a GRPO group's uid and sample): "
        "'k' and 'k0' are one row", "transport")
def _stem_index():
    def alias(k: str) -> str:
        stem, digits = re.fullmatch(r"(.*?)(\d*)", k, re.S).groups()
        return f"{stem}#{int(digits or 0)}"

    return _key_alias(alias)


@mutant("key_trailing_spaces_ignored", "key comparison ignored trailing spaces (SQL PAD SPACE: "
        "'k' = 'k '); each name lists as it was first put", "transport")
def _keys_pad():
    return _key_alias(lambda k: k.rstrip(" ") or k)


@mutant("keys_half_escaped", "keys were escaped for the record name by replacing ':' with '%3A' "
        "without escaping '%': 'a:b' and 'a%3Ab' are one row", "transport")
def _keys_escaped():
    return _key_alias(lambda k: k.replace(":", "%3A"))


@mutant("keys_as_normalised_paths", "keys were stored as file paths, normalised: './k', 'k/', "
        "'x/../k' and 'k' are one file", "transport")
def _keys_paths():
    return _key_alias(posixpath.normpath)


@mutant("long_keys_cut_for_the_index", "the key index held the first 250 bytes of each key (a "
        "file-name limit): two long keys sharing those bytes are one row", "transport")
def _keys_cut():
    return _key_alias(lambda k: k.encode()[:250].decode(errors="ignore"))


@mutant("key_seek_by_prefix", "get of a key answered with the first stored key starting with it "
        "(a seek without an equality check): a cleared 'k' returns 'kk''s row", "transport")
def _seek():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            part = self._rows.get(partition, {}) if isinstance(partition, str) else {}
            found = [k if not isinstance(k, str) or not k or k in part else
                     next((s for s in part if s.startswith(k)), k) for k in keys]
            return super().get(partition, found, select_fields)

    return _with(T)()


@mutant("underscore_is_a_wildcard", "keys were looked up with SQL LIKE, escaping '%' but not "
        "'_': 'k_x' finds 'kax' when that row comes first", "transport")
def _like():
    def pattern(k: str) -> str:
        return "".join("." if c == "_" else re.escape(c) for c in k)

    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            part = self._rows.get(partition, {}) if isinstance(partition, str) else {}
            found = [next((s for s in part if re.fullmatch(pattern(k), s, re.S)), k)
                     if isinstance(k, str) and k else k for k in keys]
            return super().get(partition, found, select_fields)

    return _with(T)()


@mutant("field_names_nfkc_normalised", "field names were NFKC-normalised (a schema that "
        "normalises identifiers): 'fi' and the ligature 'ﬁ', 'A' and fullwidth 'Ａ' are one "
        "column", "transport")
def _fields_nfkc():
    def norm(f):
        return unicodedata.normalize("NFKC", f) if isinstance(f, str) and f else f

    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            super().put(partition, keys, {norm(f): c for f, c in columns.items()}, tags)

        def get(self, partition, keys, select_fields=None):
            if select_fields is None:
                return super().get(partition, keys, None)
            cols, tags = super().get(partition, keys, [norm(f) for f in select_fields])
            return {f: cols[norm(f)] for f in select_fields}, tags

    return _with(T)()


@mutant("select_fields_as_globs", "get read select_fields as wildcard patterns ('*' any run, '?' "
        "one character) and took the first stored field matching each: 'f*' returns 'fx' when "
        "that field was stored first", "transport")
def _glob_fields():
    def matches(stored: str, pattern: str) -> bool:
        rx = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
        return re.fullmatch(rx, stored, re.S) is not None

    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            if select_fields is None:
                return super().get(partition, keys, None)
            stored = self._layouts.get(partition, {}) if isinstance(partition, str) else {}
            found = [next((s for s in stored if matches(s, f)), f)
                     if isinstance(f, str) and f else f for f in select_fields]
            cols, tags = super().get(partition, keys, found)
            return {f: cols[s] for f, s in zip(select_fields, found)}, tags

    return _with(T)()


@mutant("partition_clear_by_regex", "clear of a partition removed every partition whose name "
        "the name matches as a regular expression: clearing 'p.x' clears 'pax'", "transport")
def _regex_clear():
    class T(InMemoryDataPlane):
        def clear(self, partition, keys=None):
            super().clear(partition, keys)
            if keys is not None:
                return
            try:
                victims = [q for q in self._rows if re.fullmatch(partition, q, re.S)]
            except re.error:
                victims = []
            for q in victims:
                super().clear(q)

    return _with(T)()


@mutant("key_and_field_joined", "rows were kept in one record per `<key>:<field>`: key 'k' "
        "field 'g:f' and key 'k:g' field 'f' are one record", "transport")
def _joined_records():
    class T(InMemoryDataPlane):
        def _flat(self, partition) -> dict:
            return self.__dict__.setdefault("_records", {}).setdefault(partition, {})

        def put(self, partition, keys, columns, tags=None):
            super().put(partition, keys, columns, tags)
            for k in keys:
                for f in columns:
                    self._flat(partition)[f"{k}:{f}"] = (k, self._rows[partition][k][f])

        def get(self, partition, keys, select_fields=None):
            cols, tags = super().get(partition, keys, select_fields)
            out = {}
            for f, c in cols.items():
                rows = [self._flat(partition)[f"{k}:{f}"][1] for k in keys]
                layout = self._layouts[partition][f]
                out[f] = ObjectColumn(rows).clone() if isinstance(c, ObjectColumn) else \
                    join_rows(f, layout, rows)
            return out, tags

        def clear(self, partition, keys=None):
            super().clear(partition, keys)
            flat = self._flat(partition)
            for r in [r for r, (k, _) in flat.items() if keys is None or k in keys]:
                del flat[r]

    return _with(T)()
