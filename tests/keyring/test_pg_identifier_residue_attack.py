"""Attack (issue 19, finding 6, fixed): the keyed lookup hashes of an erased
subject's registered identifiers outlive it in PostgreSQL's dead tuples (and WAL,
replicas, PITR archives). Phone numbers and resident ids have little entropy:
anyone with the pages and the key they are keyed with recovers them by enumeration.
The identifier key is therefore replaced at every live KEK rotation (every row
re-hashed from its sealed normal form) and its old version destroyed with the old
epoch: after the erasure and one live rotation the search recovers nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from keyshred import Config, Keyshred
from keyshred.errors import KeyshredError
from tests.conftest import PG_DSN
from tests.keyring.test_pg_residue import _raw_pages, pg_schema  # noqa: F401 - fixture

PHONE_PREFIX = "+4930123"  # the attacker knows the city; 10,000 numbers to try
PERIOD = timedelta(minutes=61)


def test_a_dead_identifier_tuple_gives_back_the_erased_subjects_phone(
    pg_schema: str,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    import psycopg

    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{pg_schema}"
    config = Config.model_validate({"keyring": {"store_url": url}, "storage": {"catalog_url": url}})
    ks = Keyshred.init(tmp_path / "data", config)
    try:
        victim = "victim@example.org"
        for i in range(20):  # other subjects' rows first: the page stays after VACUUM
            ks.subjects.register_identifiers(f"other-{i}", emails=[f"o{i}@example.org"])
        ks.subjects.register_identifiers(victim, phones=[f"{PHONE_PREFIX}4567"])
        ks.memories.put(victim, ("notes",), "own", "the victim's own note")
        req = ks.erase(victim, requested_by="dpo", reason="gdpr-art17")
        assert req.state == "completed", req.error
        # The live schedule one period later: old live epochs destroyed.
        ks.backup.maintain(now=datetime.now(UTC) + PERIOD)
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f"VACUUM {pg_schema}.ks_identifiers")
        residue = b"".join(_raw_pages(f"{pg_schema}.ks_identifiers"))
        finder = ks.memories._mentions
        recovered = [
            n
            for n in range(10_000)
            if finder._hash("phone", f"{PHONE_PREFIX}{n:04d}").encode() in residue
        ]
        assert recovered == []
        # The version the dead tuple was keyed with is gone from the key store.
        assert ks.catalog.identifier_version() == 2
        with pytest.raises(KeyshredError):
            ks.keyring.identifier_key(1)
    finally:
        ks.close()
