"""Mentions found, not only declared (issue 19, item 3): registered identifiers,
detection at write, erasure of the detected memories, opt-out per scope, mention
provenance; on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyshred import Config, Keyshred
from keyshred.config import ScopeSettings, StorageSettings
from keyshred.errors import InvalidInput, KeyshredError, SubjectSuppressed
from keyshred.storage.catalog import AssetRow, Catalog
from keyshred.storage.memories import PutItem
from keyshred.storage.mentions import (
    EMAIL,
    NAME,
    PHONE,
    RESIDENT_ID,
    name_grams,
    normalize,
)
from keyshred.vault.detect import resident_id_valid

NS = ("notes",)
VICTIM = "victim-7"
EMAIL_ID = "Zofia.Kowalska@Example.org"
PHONE_DE = "+49 30 1234567"
MOBILE = "13812345678"
RESIDENT = "11010519491231002x"
NAME_ID = "Zofia  Kowalska"
CJK_NAME = "张伟"
CLEAR = [
    EMAIL_ID,
    EMAIL_ID.casefold(),
    "+49301234567",
    "301234567",
    MOBILE,
    "8613812345678",
    RESIDENT,
    RESIDENT.upper(),
    "zofia kowalska",
    "Zofia Kowalska",
    CJK_NAME,
]


def config(catalog_url: str | None) -> Config:
    return Config(
        storage=StorageSettings(catalog_url=catalog_url),
        scopes={
            "private": ScopeSettings(
                purpose="private", categories=["notes"], basis="contract", detect_mentions=False
            )
        },
    )


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", config(catalog_url))
    yield store
    store.close()


def register_victim(ks: Keyshred) -> int:
    return ks.subjects.register_identifiers(
        VICTIM,
        emails=[EMAIL_ID],
        phones=[PHONE_DE, MOBILE],
        resident_ids=[RESIDENT],
        names=[NAME_ID, CJK_NAME],
    )


def test_the_sample_resident_id_is_one_the_detector_finds() -> None:
    assert resident_id_valid(RESIDENT)


# The texts dave writes: the victim's identifiers as people write them, none declared.
WRITTEN: dict[str, Any] = {
    "email": "write to zofia.kowalska@EXAMPLE.ORG please",
    "phone-de": {"call": ["later", "+49-30-1234567"]},
    "mobile-spaced": "her mobile: +86 138 1234 5678",
    "mobile-fullwidth": "电话１３８１２３４５６７８谢谢",
    "resident": {"id card": "11010519491231002X"},
    "name": {"who": ["met", {"deep": "Met ZOFIA kowalska, yesterday."}]},
    "name-in-key": {"zofia kowalska": True},
    "cjk-name": "电话给张伟了",
}


def test_registered_identifiers_are_found_in_other_subjects_values(ks: Keyshred) -> None:
    assert register_victim(ks) == 6
    assert register_victim(ks) == 0  # idempotent
    victim = ks.subject_ref(VICTIM)
    ks.subjects.register_identifiers("dave", emails=["dave@example.org"])
    for key, value in WRITTEN.items():
        m = ks.memories.put("dave", NS, key, value)
        assert m.mentions == (victim,), key
    # The holder's own identifier is no mention of himself; a text without any
    # identifier mentions nobody; namespace and key are searched too.
    assert ks.memories.put("dave", NS, "me", "I am dave@example.org").mentions == ()
    assert ks.memories.put("dave", NS, "plain", "zofia alone, kowalski").mentions == ()
    by_key = ks.memories.put("dave", ("people", "Zofia Kowalska"), "k", 1)
    assert by_key.mentions == (victim,)
    # Declared and detected together: one mention each, the declared kept.
    both = ks.memories.put("dave", NS, "both", "zofia kowalska", mentions=["erin"])
    assert set(both.mentions) == {victim, ks.subject_ref("erin")}
    # Stored with the memory (read back) and in the catalog's mention table.
    assert ks.memories.get("dave", NS, "email").mentions == (victim,)  # type: ignore[union-attr]
    assert {a.asset_id for a in ks.catalog.mentioning(victim)} >= {
        ks.memories.get("dave", NS, k).memory_id  # type: ignore[union-attr]
        for k in WRITTEN
    }
    assert ks.catalog.mention_counts() == {"declared": 1, "detected": len(WRITTEN) + 2}


def test_put_many_looks_up_once_per_batch(ks: Keyshred, monkeypatch: pytest.MonkeyPatch) -> None:
    register_victim(ks)
    catalog = ks.memories._mentions._catalog
    calls: list[int] = []
    real = catalog.identifier_subjects

    def counted(hashes: Any) -> list[tuple[str, str]]:
        calls.append(len(hashes))
        return real(hashes)

    monkeypatch.setattr(catalog, "identifier_subjects", counted)
    items = [PutItem(NS, f"k{i}", f"note {i} about zofia kowalska") for i in range(20)]
    written = ks.memories.put_many("dave", items)
    assert len(calls) == 1
    assert all(m.mentions == (ks.subject_ref(VICTIM),) for m in written)
    # Nothing that could be an identifier (numbers are no names): no query at all.
    ks.memories.put_many("dave", [PutItem(("1",), "2", 42), PutItem(("3",), "4", [1.5, "6"])])
    assert len(calls) == 1


def test_nothing_registered_means_no_detection(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    catalog = ks.memories._mentions._catalog
    calls: list[int] = []
    monkeypatch.setattr(catalog, "identifier_subjects", lambda h: calls.append(1) or [])
    assert ks.memories.put("dave", NS, "k", f"{EMAIL_ID} zofia kowalska").mentions == ()
    assert calls == []
    # Only e-mails registered: a text of names produces no candidate (no n-grams).
    ks.subjects.register_identifiers(VICTIM, emails=[EMAIL_ID])
    ks.memories.put("dave", NS, "k", "zofia kowalska met somebody")
    assert calls == []
    ks.memories.put("dave", NS, "k", f"mail {EMAIL_ID}")
    assert len(calls) == 1


def test_a_registration_elsewhere_is_seen_within_the_ttl(catalog_url: str, tmp_path: Path) -> None:
    """Two handles on one catalog (two processes' worth): the one that saw no
    identifier asks the catalog again once ``KINDS_TTL`` has passed."""
    a = Keyshred.init(tmp_path / "a", config(catalog_url))
    b = Keyshred.open(tmp_path / "a")
    try:
        now = [0.0]
        b.memories._mentions._clock = lambda: now[0]
        assert b.memories.put("dave", NS, "k", "zofia kowalska").mentions == ()
        register_victim(a)
        now[0] += 1.5
        m = b.memories.put("dave", NS, "k", "zofia kowalska")
        assert m.mentions == (b.subject_ref(VICTIM),)
    finally:
        b.close()
        a.close()


def test_erasing_the_victim_drops_the_memories_that_mention_them(ks: Keyshred) -> None:
    register_victim(ks)
    victim = ks.subject_ref(VICTIM)
    ks.memories.put(VICTIM, NS, "own", "victim's own note")
    mentioning = ks.memories.put("dave", NS, "fact", {"text": "zofia kowalska, +49 30 1234567"})
    ks.memories.put("dave", NS, "other", "dave likes tea")
    assert mentioning.mentions == (victim,)
    assert ks.catalog.count_identifiers(victim) == 6

    req = ks.erase(VICTIM, requested_by="dpo", reason="art17")
    assert req.state == "completed", req.error
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None
    checks = {c.name: c.passed for c in receipt.verification}
    assert checks["no registered identifier left"] is True
    assert checks["no asset mentions the subject"] is True
    assert {d.asset_id: d.action for d in receipt.derived} == {mentioning.memory_id: "dropped"}
    assert ks.memories.get("dave", NS, "fact") is None
    assert ks.memories.get("dave", NS, "other") is not None
    assert ks.catalog.count_identifiers(victim) == 0
    # The identifiers are gone: the same text mentions nobody now.
    assert ks.memories.put("dave", NS, "again", "zofia kowalska").mentions == ()
    # Registering for an erased subject is refused like any write.
    with pytest.raises(SubjectSuppressed):
        register_victim(ks)


def test_an_update_is_scanned_again(ks: Keyshred) -> None:
    """``update`` writes through the same path as ``put``: a new value is scanned
    like a first one."""
    register_victim(ks)
    ks.memories.put("dave", NS, "k", "nothing yet")
    updated = ks.memories.update("dave", NS, "k", "call 11010519491231002X's owner")
    assert updated.mentions == (ks.subject_ref(VICTIM),)
    assert ks.catalog.mention_counts() == {"declared": 0, "detected": 1}


def test_registering_for_a_suppressed_subject_is_refused(ks: Keyshred) -> None:
    ks.catalog.suppress(ks.subject_ref(VICTIM))
    with pytest.raises(SubjectSuppressed):
        ks.subjects.register_identifiers(VICTIM, names=[NAME_ID])
    assert ks.catalog.count_identifiers(ks.subject_ref(VICTIM)) == 0


def test_opt_out_scope_does_not_detect(ks: Keyshred) -> None:
    register_victim(ks)
    text = "zofia kowalska called from +49 30 1234567"
    assert ks.memories.put("dave", NS, "a", text).mentions == (ks.subject_ref(VICTIM),)
    private = ks.memories.put("dave", NS, "b", text, scope="private")
    assert private.mentions == ()
    declared = ks.memories.put("dave", NS, "c", text, scope="private", mentions=[VICTIM])
    assert declared.mentions == (ks.subject_ref(VICTIM),)  # declaring still works


def test_forget_identifiers(ks: Keyshred) -> None:
    register_victim(ks)
    assert ks.subjects.forget_identifiers(VICTIM) == 6
    assert ks.memories.put("dave", NS, "k", "zofia kowalska").mentions == ()
    assert ks.subjects.forget_identifiers(VICTIM) == 0


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [
        ({"emails": ["no-at-sign"]}, "email"),
        ({"phones": ["call me maybe"]}, "phone"),
        ({"resident_ids": ["--"]}, "resident_id"),
        ({"names": ["one two three four five"]}, "name"),
        ({"names": ["..."]}, "name"),
        ({"names": ["Louis 14"]}, "name"),
        ({"names": "Zofia"}, "name"),  # a string, not a list of them
        ({"emails": [""]}, "email"),
        ({"emails": ["\ud800@example.org"]}, "email"),
    ],
)
def test_invalid_identifiers_are_refused_without_echo(
    ks: Keyshred, kwargs: dict[str, Any], kind: str
) -> None:
    with pytest.raises(InvalidInput) as info:
        ks.subjects.register_identifiers(VICTIM, **kwargs)
    assert kind in str(info.value)
    for values in kwargs.values():
        for v in [values] if isinstance(values, str) else values:
            if len(v) > 3:
                assert v not in str(info.value)


def test_no_clear_identifier_in_any_file_or_row(
    ks: Keyshred, catalog_url: str, tmp_path: Path
) -> None:
    """The catalog (SQLite file, PostgreSQL rows) and every other file of the data
    folder hold the identifiers only as hashes: no clear form, however encoded."""
    register_victim(ks)
    for key, value in WRITTEN.items():
        ks.memories.put("dave", NS, key, value)
    ks.memories.flush()
    rows = b""
    if catalog_url.startswith("postgresql"):
        with ks.catalog.engine.connect() as conn:
            for table in sa.inspect(conn).get_table_names():
                for (doc,) in conn.exec_driver_sql(f'SELECT row_to_json(t)::text FROM "{table}" t'):
                    rows += doc.encode() + b"\n"
        assert b"ks_identifiers" not in rows  # sanity: rows, not table names
        assert rows.count(b'"kind":"name","created_at"') == 2  # the two names' rows
    ks.close()
    blobs = [rows] + [p.read_bytes() for p in (tmp_path / "data").rglob("*") if p.is_file()]
    needles = set()
    for clear in CLEAR:
        needles |= {clear.encode(), json.dumps(clear).encode(), clear.encode().hex().encode()}
        if len(clear) >= 5:  # shorter UTF-16 forms turn up by chance in ciphertext
            needles.add(clear.encode("utf-16-le"))
    for blob in blobs:
        for needle in needles:
            assert needle not in blob


def _identifier_rows(ks: Keyshred) -> dict[tuple[str, str], bytes | None]:
    with ks.catalog.engine.connect() as conn:
        return {
            (str(h), str(r)): None if b is None else bytes(b)
            for h, r, b in conn.exec_driver_sql(
                "SELECT hash, subject_ref, sealed FROM ks_identifiers"
            )
        }


def test_a_kek_rotation_rotates_the_identifier_key_and_rehashes(ks: Keyshred) -> None:
    """The identifier key is not re-wrapped but replaced at every live rotation:
    every row re-hashed from its sealed normal form, the old version's secret row
    deleted (it was only ever wrapped under the old epoch), detection unchanged,
    also in a process that opens the folder afterwards."""
    register_victim(ks)
    victim = ks.subject_ref(VICTIM)
    before = _identifier_rows(ks)
    assert len(before) == 6 and all(b is not None for b in before.values())
    old_key = ks.keyring.identifier_key()
    rotated = ks.keyring.rotate_kek()
    names = {s.name for s in ks.keyring.store.secrets()}
    assert "identifier-key" not in names and "identifier-key.v2" in names
    epochs = {s.name: s.kek_epoch for s in ks.keyring.store.secrets()}
    assert epochs["identifier-key.v2"] == rotated.new_epoch
    assert ks.catalog.identifier_version() == 2
    after = _identifier_rows(ks)
    assert len(after) == 6 and not set(before) & set(after)
    assert {r for _, r in after} == {victim}
    assert ks.keyring.identifier_key(2) != old_key
    with pytest.raises(KeyshredError):
        ks.keyring.identifier_key(1)  # destroyed, never made again
    for key, value in WRITTEN.items():
        assert ks.memories.put("dave", NS, key, value).mentions == (victim,), key
    # A second rotation moves on to version 3; a rotation without new epoch none.
    ks.keyring.rotate_kek()
    assert ks.catalog.identifier_version() == 3
    ks.keyring.rewrap_to_current()
    assert ks.catalog.identifier_version() == 3
    ks.close()
    again = Keyshred.open(ks.path)
    try:
        m = again.memories.put("dave", NS, "k", "zofia kowalska")
        assert m.mentions == (again.subject_ref(VICTIM),)
    finally:
        again.close()


def test_another_process_follows_the_new_identifier_key(ks: Keyshred, catalog_url: str) -> None:
    """A process that cached the old version picks up the new one: its next
    registration is refused by the catalog and re-hashed, its detection after at
    most ``KINDS_TTL``."""
    if not catalog_url.startswith("postgresql"):
        pytest.skip("two processes on one catalog: PostgreSQL")
    other = Keyshred.open(ks.path)
    try:
        register_victim(other)  # caches version 1
        finder = other.memories._mentions
        assert finder._version == 1
        ks.keyring.rotate_kek()
        assert other.subjects.register_identifiers("carol", names=["Carol Danvers"]) == 1
        assert finder._version == 2
        assert ks.memories.put("dave", NS, "k", "met carol danvers").mentions == (
            ks.subject_ref("carol"),
        )
        ks.keyring.rotate_kek()  # version 3, the other process still holds 2
        now = [1e9]
        finder._clock = lambda: now[0]
        finder._version_read = now[0]
        assert finder._version == 2
        now[0] += 2  # past KINDS_TTL
        m = other.memories.put("dave", NS, "k2", "zofia kowalska")
        assert m.mentions == (other.subject_ref(VICTIM),)
        assert finder._version == 3
    finally:
        other.close()


def test_a_rehash_deletes_rows_of_destroyed_keys_and_keeps_unsealed_ones(
    ks: Keyshred,
) -> None:
    register_victim(ks)
    ks.subjects.register_identifiers("carol", names=["Carol Danvers"])
    carol = ks.subject_ref("carol")
    # A row from before sealed values (a migrated catalog): kept, it cannot be
    # re-hashed; re-registering the identifier makes it match again.
    with ks.catalog.engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO ks_identifiers (hash, subject_ref, kind, created_at) "
            "VALUES ('00ff', 'legacy-ref', 'email', CURRENT_TIMESTAMP)"
        )
    ks.keyring.destroy(ks.subject_ref(VICTIM))  # the key gone, the rows not (yet)
    assert ks.catalog.count_identifiers(ks.subject_ref(VICTIM)) == 6
    ks.keyring.rotate_kek()
    assert ks.catalog.count_identifiers(ks.subject_ref(VICTIM)) == 0
    assert ks.catalog.count_identifiers("legacy-ref") == 1
    assert ks.catalog.count_identifiers(carol) == 1
    assert ks.memories.put("dave", NS, "k", "carol danvers").mentions == (carol,)


def test_a_catalog_without_sealed_identifiers_is_migrated(catalog_url: str, tmp_path: Path) -> None:
    ks = Keyshred.init(tmp_path / "data", config(catalog_url))
    try:
        with ks.catalog.engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE ks_identifiers DROP COLUMN sealed")
            conn.exec_driver_sql("DROP TABLE ks_alembic_catalog")  # from before versions
    finally:
        ks.close()
    again = Keyshred.open(tmp_path / "data")
    try:
        cols = {c["name"] for c in sa.inspect(again.catalog.engine).get_columns("ks_identifiers")}
        assert "sealed" in cols
        register_victim(again)
        assert all(b is not None for b in _identifier_rows(again).values())
    finally:
        again.close()


def test_old_catalogs_gain_the_mention_provenance_column(catalog_url: str) -> None:
    """A mention table from before ``how``: opening adds it, old rows declared."""
    from keyshred.migrations import migrate_catalog
    from keyshred.migrations.baseline import assets

    engine = sa.create_engine(catalog_url)
    with engine.begin() as conn:
        assets.create(conn)  # a catalog from before versioned migrations
        conn.exec_driver_sql(
            "CREATE TABLE ks_asset_mentions (asset_id VARCHAR(64) NOT NULL, "
            "subject_ref VARCHAR(64) NOT NULL, PRIMARY KEY (asset_id, subject_ref))"
        )
        conn.exec_driver_sql("INSERT INTO ks_asset_mentions VALUES ('a1', 'ref1')")
    engine.dispose()
    catalog = Catalog(catalog_url, migrate=migrate_catalog)
    try:
        assert catalog.mention_counts() == {"declared": 1, "detected": 0}
        now = datetime.now(UTC)
        row = AssetRow("a2", "ref9", "default", "memory", "parquet", "k", "p", "c", now, None)
        catalog.insert_assets(
            [catalog.asset_params(row)],
            scopes=[("ref9", "default")],
            mentions=[("a2", "ref2"), ("a2", "ref3")],
            detected=[("a2", "ref3")],
        )
    finally:
        catalog.close()
    again = Catalog(catalog_url, migrate=migrate_catalog)  # a second open finds the column
    try:
        assert again.mention_counts() == {"declared": 2, "detected": 1}
        assert again.mentioning("ref3")[0].mentions == ("ref2", "ref3")
    finally:
        again.close()


def test_normal_forms() -> None:
    assert normalize(EMAIL, "  Zofia.K@Example.ORG ") == "zofia.k@example.org"
    assert normalize(PHONE, "+49 (30) 123-4567") == "+49301234567"
    assert normalize(PHONE, "138 1234 5678") == normalize(PHONE, "+86-138-1234-5678")
    assert normalize(PHONE, "１３８１２３４５６７８") == "+8613812345678"
    assert normalize(RESIDENT_ID, "110105-19491231-002x") == "11010519491231002X"
    assert normalize(NAME, " ZOFIA\t\u00a0Kowalska ") == "zofia kowalska"
    assert normalize(NAME, "Ｚｏｆｉａ") == "zofia"  # NFKC
    assert normalize(NAME, "张 伟") == normalize(NAME, "张伟") == "张伟"
    assert normalize(NAME, "O'Brien") == normalize(NAME, "o’brien") == "o'brien"
    assert name_grams("Hi, Zofia Kowalska!") == [
        "hi",
        "zofia",
        "kowalska",
        "hi zofia",
        "zofia kowalska",
        "hi zofia kowalska",
    ]
    assert name_grams("Hi 7 Zofia Kowalska 2026!", [2]) == ["zofia kowalska"]
    assert name_grams("电话给张伟了", [2])[3] == "张伟"


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(namespace=st.text() | st.lists(st.text(), max_size=3), key=st.text(), value=_json)
def test_the_finder_raises_nothing_but_keyshred_errors(
    detecting: Keyshred, namespace: Any, key: str, value: Any
) -> None:
    finder = detecting.memories._mentions
    item = PutItem(namespace, key, value)
    try:
        found = finder.find(detecting.subject_ref("dave"), [item])
    except KeyshredError:
        return
    assert len(found) == 1 and isinstance(found[0], frozenset)
    for kind in (EMAIL, PHONE, RESIDENT_ID, NAME):
        for text in (key, *([namespace] if isinstance(namespace, str) else namespace)):
            normal = normalize(kind, text)
            assert normal is None or isinstance(normal, str)


@pytest.fixture
def detecting(tmp_path: Path) -> Iterator[Keyshred]:
    """An embedded store with every kind registered, so every path of the finder
    runs (detector, phone parsing, n-grams, the catalog query)."""
    store = Keyshred.init(tmp_path / "data", config(None))
    register_victim(store)
    yield store
    store.close()


def test_phone_normal_form_is_what_phonenumbers_formats() -> None:
    """The shortcuts of the phone normal form (mainland mobiles, plain E.164
    digits) give what ``phonenumbers`` parses and formats, on every region's
    example numbers and on random E.164 strings it accepts."""
    import random

    import phonenumbers as pn

    def parsed(value: str) -> str | None:
        try:
            number = pn.parse(value, "CN")
        except pn.NumberParseException:
            return None
        if not pn.is_possible_number(number):
            return None
        return str(pn.format_number(number, pn.PhoneNumberFormat.E164))

    values = []
    for region in pn.SUPPORTED_REGIONS:
        for kind in (pn.PhoneNumberType.MOBILE, pn.PhoneNumberType.FIXED_LINE):
            example = pn.example_number_for_type(region, kind)
            if example is not None:
                values += [
                    pn.format_number(example, pn.PhoneNumberFormat.INTERNATIONAL),
                    pn.format_number(example, pn.PhoneNumberFormat.E164),
                ]
    rng = random.Random(19)
    values += [
        f"+{rng.randint(1, 9)}" + "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(6, 14)))
        for _ in range(5000)
    ]
    values += ["138 1234 5678", "+86 138-1234-5678", "0086 13812345678", "8613812345678"]
    for value in values:
        expected = parsed(value)
        if expected is not None:
            assert normalize(PHONE, value) == expected, value


def test_a_failed_rehash_blocks_the_old_epoch_and_is_resumed(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old identifier key stays wrapped under the old epoch until a re-hash
    succeeds, so that epoch cannot be destroyed meanwhile (nor can detection
    break); the next re-wrap finishes the rotation into the version made before."""
    from keyshred.errors import BackendUnavailable

    register_victim(ks)
    victim = ks.subject_ref(VICTIM)
    catalog = ks.catalog
    real = catalog.rehash_identifiers

    def down(*args: Any, **kwargs: Any) -> Any:
        raise BackendUnavailable("the catalog cannot be reached")

    monkeypatch.setattr(catalog, "rehash_identifiers", down)
    with pytest.raises(BackendUnavailable):
        ks.keyring.rotate_kek()
    current = ks.keyring.live_epoch().epoch
    with pytest.raises(KeyshredError):
        ks.keyring.destroy_kek_epochs_before(current, force=True)
    assert catalog.identifier_version() == 1
    assert ks.memories.put("dave", NS, "k", "zofia kowalska").mentions == (victim,)
    monkeypatch.setattr(catalog, "rehash_identifiers", real)
    ks.keyring.rewrap_to_current()
    assert catalog.identifier_version() == 2
    names = {s.name for s in ks.keyring.store.secrets()}
    assert {n for n in names if n.startswith("identifier-key")} == {"identifier-key.v2"}
    ks.keyring.destroy_kek_epochs_before(current, force=True)
    assert ks.memories.put("dave", NS, "k", "zofia kowalska").mentions == (victim,)


def test_a_partition_counts_the_subjects_its_rows_mention(ks: Keyshred) -> None:
    """``Partition.mentions`` (asked of every open partition by each eviction) reads
    a count kept as rows come and go, and answers what a pass over the rows would."""
    erin, frank = ks.subject_ref("erin"), ks.subject_ref("frank")
    part = ks.memories._partition(ks.subject_ref("dave"))

    def scan(ref: str) -> bool:
        return any(ref in row.mentions for row in part.rows.values())

    def agree() -> None:
        for ref in (erin, frank):
            assert part.mentions(ref) is scan(ref)

    ks.memories.put("dave", NS, "a", "about erin", mentions=["erin"])
    ks.memories.put("dave", NS, "b", "about both", mentions=["erin", "frank"])
    agree()
    assert part.mentions(erin) and part.mentions(frank)
    ks.memories.put("dave", NS, "b", "about nobody now")  # an update drops its mentions
    agree()
    assert not part.mentions(frank)
    ks.memories.delete("dave", NS, "a")
    agree()
    assert not part.mentions(erin)
    ks.memories.put("dave", NS, "c", "about frank", mentions=["frank"])
    part.close()  # reloaded from the catalog: counted again
    ks.memories.get("dave", NS, "c")
    part = ks.memories._partition(ks.subject_ref("dave"))
    agree()
    assert part.mentions(frank) and not part.mentions(erin)
