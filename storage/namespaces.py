"""The namespace index: which subjects hold memories under a namespace prefix, kept in
the catalog as keyed lookups, so that a search or a namespace listing across subjects
reads a few index rows instead of opening every subject's partition (issue #25).

A namespace is personal data (a user id is often one of its labels), so it is never in
the catalog in clear:

- ``ks_mem_ns_prefixes`` holds ``HMAC-SHA256(namespace-lookup-key, prefix)`` of every
  prefix of every indexed namespace, with the subject_ref and the namespace's own
  hash: "the subjects with namespaces under P" is one range of its primary key. The
  key is a system secret of the keyring (wrapped by the KEK, never in the catalog);
- ``ks_mem_namespaces`` holds one row per (subject, namespace, key its memories are
  sealed under): the labels sealed under that very key (the subject's scope key, or
  the owner-set key of memories about other subjects), so every erasure that makes
  the memories unreadable makes their namespace unreadable too; and the creation
  time of the first memory filed under it (a lower bound of the namespace's first:
  the order of a search across subjects).

The memory store keeps the index in step with its partitions: a put adds the row of
a namespace new for the subject (the partition's counts tell, under its lock, in the
put's own transaction; an existing namespace costs nothing), a deletion removes the
rows whose last memory went, a scope's or subject's drop removes theirs. The index is
therefore a superset of what reads may show: memories past their retention (not yet
swept) and suppressed scopes are filtered by the reader, suppressed and erased
subjects by the query itself (before anything is decrypted).

Partitions written before revision 0011 are listed in ``ks_mem_ns_pending`` by the
migration and indexed from their partition before the next cross-subject read
(``MemoryStore.index_pending``): lazily, once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from keyshred import db
from keyshred.errors import IntegrityError, KeyNotFound, SubjectErased
from keyshred.keyring import _primitives as prim
from keyshred.keyring.datakey import DataKey
from keyshred.keyring.envelope import Place
from keyshred.keyring.keyring import Keyring
from keyshred.storage.catalog import Catalog
from keyshred.storage.catalog_base import ACTIVE
from keyshred.storage.schema import (
    memory_namespaces,
    memory_ns_pending,
    memory_ns_prefixes,
    subject_guard,
)

__all__ = ["PAGE", "Entry", "Listed", "NamespaceIndex", "labels_place"]

_DOMAIN = b"keyshred/namespace\x00"
_HASH_HEX = 32  # 128 bits of the HMAC, as the catalog's other lookup hashes
# Index rows read (and labels decrypted) at a time by a listing across subjects.
PAGE = 2000
# A prefix spanning more namespaces is paged in first-time order by a walk of that
# index (``NamespaceIndex._dense``).
_SORTED_AT_MOST = 20_000


@dataclass(frozen=True, slots=True)
class Entry:
    """A namespace to index for a subject, under the key its memories are sealed under."""

    namespace: tuple[str, ...]
    key: DataKey
    first_us: int

    def __repr__(self) -> str:
        return f"Entry(scope={self.key.scope!r}, first_us={self.first_us})"


@dataclass(frozen=True, slots=True)
class Listed:
    """One visible row of the index (ids, hashes and ciphertext only)."""

    subject_ref: str
    ns_hash: str
    key_id: str
    scope: str
    first_us: int
    labels: bytes | None  # sealed; None when not asked for


def labels_place(subject_ref: str, scope: str, ns_hash: str, key_id: str) -> Place:
    """Where a sealed namespace belongs: moved to another subject, scope, namespace
    or key row it fails to open."""
    return Place(subject_ref, scope, "memns", f"{ns_hash}.{key_id}", "labels")


def _p(name: str) -> Any:
    return sa.bindparam(name)


class NamespaceIndex:
    """The index's statements on one catalog, and its lookup hashes."""

    def __init__(self, catalog: Catalog, keyring: Keyring) -> None:
        self._catalog = catalog
        self._keyring = keyring
        self._key: bytes | None = None
        self.page_size = PAGE
        ns, pre = memory_namespaces, memory_ns_prefixes
        self._sql = catalog.compile(
            {
                "add": catalog.insert_ignore(ns).values(
                    subject_ref=_p("ref"),
                    ns_hash=_p("ns"),
                    key_id=_p("kid"),
                    scope=_p("scope"),
                    first_us=_p("first"),
                    labels=_p("labels"),
                ),
                "add_prefix": catalog.insert_ignore(pre).values(
                    prefix_hash=_p("prefix"), subject_ref=_p("ref"), ns_hash=_p("ns")
                ),
                "lower": ns.update()
                .where(
                    ns.c.subject_ref == _p("ref"),
                    ns.c.ns_hash == _p("ns"),
                    ns.c.key_id == _p("kid"),
                    ns.c.first_us > _p("first"),
                )
                .values(first_us=_p("first")),
                "remove": ns.delete().where(
                    ns.c.subject_ref == _p("ref"),
                    ns.c.ns_hash == _p("ns"),
                    ns.c.key_id == _p("kid"),
                ),
                **{
                    f"clear_{table.name}": table.delete().where(table.c.subject_ref == _p("ref"))
                    for table in (memory_namespaces, memory_ns_prefixes, memory_ns_pending)
                },
                # A namespace's prefixes go with its last row (another key may hold it).
                "remove_prefixes": pre.delete().where(
                    pre.c.subject_ref == _p("ref"),
                    pre.c.ns_hash == _p("ns"),
                    ~sa.exists().where(ns.c.subject_ref == _p("ref"), ns.c.ns_hash == _p("ns")),
                ),
            }
        )

    # -- hashes --------------------------------------------------------------------

    def _lookup_key(self) -> bytes:
        if self._key is None:
            self._key = self._keyring.namespace_key()
        return self._key

    def hash(self, labels: Sequence[str]) -> str:
        """The keyed hash of a namespace or prefix (length-prefixed labels, so
        ``("a", "bc")`` and ``("ab", "c")`` differ)."""
        parts = [_DOMAIN]
        for label in labels:
            raw = label.encode("utf-8", "surrogatepass")
            parts += [len(raw).to_bytes(4, "big"), raw]
        return prim.hmac_sha256(self._lookup_key(), b"".join(parts)).hex()[:_HASH_HEX]

    # -- writes --------------------------------------------------------------------

    def change(
        self,
        ref: str,
        added: Sequence[Entry] = (),
        removed: Iterable[tuple[tuple[str, ...], str]] = (),
        lowered: Iterable[tuple[tuple[str, ...], str, int]] = (),
    ) -> Callable[[Any], None] | None:
        """Statements for a caller's transaction (a put's): index ``added``, remove
        the rows (namespace, key id hex) of ``removed``, and lower the first-memory
        time of rows a memory moved into; None when there is nothing to do."""
        adds, prefixes = [], []
        for e in added:
            ns_hash = self.hash(e.namespace)
            kid = e.key.key_id.hex()
            place = labels_place(ref, e.key.scope, ns_hash, kid)
            labels = e.key.seal(json.dumps(list(e.namespace)).encode("utf-8"), place)
            adds.append(
                {
                    "ref": ref,
                    "ns": ns_hash,
                    "kid": kid,
                    "scope": e.key.scope,
                    "first": e.first_us,
                    "labels": labels,
                }
            )
            prefixes += [
                {"prefix": self.hash(e.namespace[:n]), "ref": ref, "ns": ns_hash}
                for n in range(1, len(e.namespace) + 1)
            ]
        gone = [{"ref": ref, "ns": self.hash(ns), "kid": kid} for ns, kid in removed]
        lower = [
            {"ref": ref, "ns": self.hash(ns), "kid": kid, "first": first}
            for ns, kid, first in lowered
        ]
        if not (adds or gone or lower):
            return None
        sql = self._sql

        def run(cur: Any) -> None:
            if gone:
                cur.executemany(sql["remove"], gone)
                cur.executemany(
                    sql["remove_prefixes"], [{"ref": g["ref"], "ns": g["ns"]} for g in gone]
                )
            if adds:
                cur.executemany(sql["add"], adds)
                cur.executemany(sql["add_prefix"], prefixes)
            if lower:
                cur.executemany(sql["lower"], lower)

        return run

    def apply(self, run: Callable[[Any], None] | None) -> None:
        """``change``'s statements in a transaction of their own."""
        if run is not None:
            with self._catalog.hot(write=True) as cur:
                run(cur)

    def replace(self, ref: str, entries: Sequence[Entry]) -> None:
        """Index the subject afresh from its partition (a pending subject, a repair):
        its rows replaced by ``entries`` and its pending mark removed, in one commit."""
        run = self.change(ref, entries)
        with self._catalog.hot(write=True) as cur:
            for table in (memory_namespaces, memory_ns_prefixes, memory_ns_pending):
                cur.execute(self._sql[f"clear_{table.name}"], {"ref": ref})
            if run is not None:
                run(cur)

    def drop(
        self, ref: str, scope: str | None = None, *, key_ids: Iterable[str] | None = None
    ) -> int:
        """Remove the subject's rows (a subject's erasure), or one scope's, or those
        sealed under ``key_ids`` (hex; keys destroyed by another subject's erasure);
        returns how many namespace rows went."""
        ns, pre, pending = memory_namespaces, memory_ns_prefixes, memory_ns_pending
        with self._catalog.transaction() as conn:
            if scope is None and key_ids is None:
                n = conn.execute(ns.delete().where(ns.c.subject_ref == ref)).rowcount
                conn.execute(pre.delete().where(pre.c.subject_ref == ref))
                conn.execute(pending.delete().where(pending.c.subject_ref == ref))
                return int(n)
            where = ns.c.subject_ref == ref
            if scope is not None:
                where = sa.and_(where, ns.c.scope == scope)
            if key_ids is not None:
                where = sa.and_(where, ns.c.key_id.in_(sorted(set(key_ids))))
            n = conn.execute(ns.delete().where(where)).rowcount
            left = sa.select(ns.c.ns_hash).where(ns.c.subject_ref == ref)
            conn.execute(pre.delete().where(pre.c.subject_ref == ref, pre.c.ns_hash.not_in(left)))
            return int(n)

    # -- reads ---------------------------------------------------------------------

    def pending(self) -> list[str]:
        """Subjects written before the index existed and not indexed yet."""
        with self._catalog.read() as conn:
            return [str(r) for (r,) in conn.execute(sa.select(memory_ns_pending.c.subject_ref))]

    def count(self, ref: str) -> int:
        """How many index rows (namespace and prefix rows) the subject has."""
        with self._catalog.read() as conn:
            return sum(
                int(
                    conn.execute(
                        sa.select(sa.func.count()).where(table.c.subject_ref == ref)
                    ).scalar()
                    or 0
                )
                for table in (memory_namespaces, memory_ns_prefixes)
            )

    def listed(
        self, prefix: Sequence[str], *, labels: bool = False, refs: Iterable[str] | None = None
    ) -> list[Listed]:
        """The rows of namespaces under ``prefix`` of every subject that is not
        suppressed or erased, without rows of suppressed scopes (decided from the
        guard in the same query, before anything is decrypted); ``refs`` restricts
        them to those subjects."""
        query = self._query(prefix, labels, refs)
        with self._catalog.read() as conn:
            rows = conn.execute(query).all()
        return self._visible(rows, labels)

    def pages(
        self,
        prefix: Sequence[str],
        *,
        labels: bool = False,
        by_first: bool = False,
        first_size: int | None = None,
    ) -> Iterator[list[Listed]]:
        """``listed`` a page of ``page_size`` index rows at a time (each page its own
        read; a page may come out empty where every row of it is hidden): in the
        order of the primary key, or ``by_first`` in the order of the namespaces'
        first times. What the caller holds is one page, whatever the catalog holds:
        a listing over 1,000,000 subjects read them all into memory at once. A
        caller that expects to stop early names a smaller ``first_size``: pages
        start there and double up to ``page_size``."""
        ns, pre = memory_namespaces.c, memory_ns_prefixes.c
        probe = by_first and bool(prefix) and self._dense(prefix)
        if by_first:
            order = [ns.first_us, ns.subject_ref, ns.ns_hash, ns.key_id]
        elif prefix:
            # The prefix rows' own key order (the join's ``ns`` columns are equal,
            # but ordering by them made SQLite sort every matching row per page).
            order = [pre.subject_ref, pre.ns_hash, ns.key_id]
        else:
            order = [ns.subject_ref, ns.ns_hash, ns.key_id]
        after: tuple[Any, ...] | None = None
        size = self.page_size if first_size is None else max(1, min(first_size, self.page_size))
        while True:
            query = self._query(prefix, labels, None, probe=probe).order_by(*order).limit(size)
            if after is not None:
                # Keyset paging: the next page starts after the last row read (an
                # index range, where an OFFSET would skip over every earlier row).
                query = query.where(sa.tuple_(*order) > sa.tuple_(*map(sa.literal, after)))
            with self._catalog.read() as conn:
                rows = conn.execute(query).all()
            yield self._visible(rows, labels)
            if len(rows) < size:
                return
            last = rows[-1]
            after = (last.subject_ref, last.ns_hash, last.key_id)
            if by_first:
                after = (last.first_us, *after)
            size = min(2 * size, self.page_size)

    def _dense(self, prefix: Sequence[str]) -> bool:
        """Whether ``prefix`` spans more than ``_SORTED_AT_MOST`` namespaces (a count
        that stops there). Pages in first-time order are then read by walking the
        first-time index and probing each row's prefix (a few rows per match): sorting
        every match per page (the join's plan) would cost a sort of up to every row of
        the catalog for each page. Fewer matches are sorted, which costs little, where
        the walk might pass over most of the index between two matches."""
        pre = memory_ns_prefixes.c
        capped = (
            sa.select(sa.literal(1))
            .where(pre.prefix_hash == self.hash(prefix))
            .limit(_SORTED_AT_MOST + 1)
            .subquery()
        )
        with self._catalog.read() as conn:
            n = int(conn.execute(sa.select(sa.func.count()).select_from(capped)).scalar() or 0)
        return n > _SORTED_AT_MOST

    def _query(
        self,
        prefix: Sequence[str],
        labels: bool,
        refs: Iterable[str] | None,
        *,
        probe: bool = False,
    ) -> Any:
        ns, pre, g = memory_namespaces, memory_ns_prefixes, subject_guard
        cols = [ns.c.subject_ref, ns.c.ns_hash, ns.c.key_id, ns.c.scope, ns.c.first_us]
        if labels:
            cols.append(ns.c.labels)
        query = sa.select(*cols, g.c.status, g.c.suppressed_scopes)
        if prefix and probe:
            query = query.select_from(ns.outerjoin(g, g.c.subject_ref == ns.c.subject_ref)).where(
                sa.exists().where(
                    pre.c.prefix_hash == self.hash(prefix),
                    pre.c.subject_ref == ns.c.subject_ref,
                    pre.c.ns_hash == ns.c.ns_hash,
                )
            )
        elif prefix:
            source = pre.join(
                ns, sa.and_(ns.c.subject_ref == pre.c.subject_ref, ns.c.ns_hash == pre.c.ns_hash)
            )
            query = query.select_from(
                source.outerjoin(g, g.c.subject_ref == ns.c.subject_ref)
            ).where(pre.c.prefix_hash == self.hash(prefix))
        else:
            query = query.select_from(ns.outerjoin(g, g.c.subject_ref == ns.c.subject_ref))
        if refs is not None:
            query = query.where(ns.c.subject_ref.in_(sorted(set(refs))))
        return query

    def _visible(self, rows: Sequence[Any], labels: bool) -> list[Listed]:
        out: list[Listed] = []
        hidden: dict[str, frozenset[str]] = {}
        for r in rows:
            if r.status is not None and r.status != ACTIVE:
                continue
            scopes = hidden.get(r.suppressed_scopes or "[]")
            if scopes is None:
                scopes = hidden[r.suppressed_scopes or "[]"] = frozenset(
                    json.loads(r.suppressed_scopes or "[]")
                )
            if r.scope in scopes:
                continue
            out.append(
                Listed(
                    str(r.subject_ref),
                    str(r.ns_hash),
                    str(r.key_id),
                    str(r.scope),
                    int(r.first_us),
                    db.blob(r.labels) if labels else None,
                )
            )
        return out

    def open_labels(
        self,
        rows: Sequence[Listed],
        visible: Callable[[Sequence[Listed]], Sequence[Listed]] | None = None,
        *,
        cache: bool = True,
    ) -> dict[tuple[str, str], tuple[str, ...]]:
        """The namespaces of ``rows`` by (subject_ref, namespace hash), decrypted
        with one batch of key lookups (``cache=False``: keys not in the keyring's
        cache are not put there, where a listing of every subject would push the
        hot keys out). Rows whose
        key was destroyed (the erasure of a subject their memories are about made
        them unreadable) are skipped, and deleted: their hashes have nothing left to
        find. ``visible(rows)`` is asked once the keys are at hand and before
        anything is decrypted, and returns the rows still visible: a subject (or
        scope) suppressed since the rows were read is skipped."""
        keys = self._keys({bytes.fromhex(r.key_id) for r in rows if r.labels is not None}, cache)
        if visible is not None:
            rows = visible(rows)
        out: dict[tuple[str, str], tuple[str, ...]] = {}
        dead: dict[str, set[str]] = {}
        for r in rows:
            at = (r.subject_ref, r.ns_hash)
            key = keys.get(bytes.fromhex(r.key_id))
            if key is None:
                dead.setdefault(r.subject_ref, set()).add(r.key_id)
            if at in out or key is None or r.labels is None:
                continue
            payload = key.open(r.labels, labels_place(r.subject_ref, r.scope, r.ns_hash, r.key_id))
            try:
                labels = json.loads(payload)
                ok = isinstance(labels, list) and all(isinstance(x, str) for x in labels)
            except ValueError:
                ok = False
            # (The place binds the row's hash: a ciphertext moved here fails to open.)
            if not ok:
                raise IntegrityError(
                    f"the namespace index of subject_ref {r.subject_ref} holds a malformed row"
                )
            out[at] = tuple(labels)
        for ref, kids in dead.items():
            self.drop(ref, key_ids=kids)
        return out

    def _keys(self, key_ids: set[bytes], cache: bool) -> dict[bytes, DataKey]:
        """The DEKs with these ids (one batch); those destroyed are absent."""
        try:
            return self._keyring.data_keys_by_id(key_ids, cache=cache, missing_ok=True)
        except (SubjectErased, KeyNotFound):
            pass  # a KEK epoch destroyed: the others one by one
        out = {}
        for kid in key_ids:
            try:
                out[kid] = self._keyring.data_key_by_id(kid)
            except (SubjectErased, KeyNotFound):
                continue
        return out
