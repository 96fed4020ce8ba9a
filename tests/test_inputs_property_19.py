"""Bad input to issue 19's public API gets a typed error, property-based.

Hypothesis drives ``ks.subjects``, ``update``/``correct`` with mentions and
sources, ``ks.erasure.residue_scan``, ``ks.keyring.data_key(owners=…)`` and
``keyshred verify residue`` with arbitrary values. Every call either works or raises
a ``KeyshredError`` (the CLI exits 0, 1 or 2); and a refused call leaves the data as
it was: registered identifiers, a memory's value and provenance, the key store."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from keyshred import Keyshred
from keyshred.errors import KeyshredError
from keyshred.storage.schema import identifiers
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words
from tests.test_inputs_property import SETTINGS, anything, wild_text

VICTIM = "victim@example.com"
PHONE = "13812345678"
NS = ("facts",)


def _only_typed_errors(call: Callable[[], object]) -> bool:
    """True if the call worked, False if it raised a ``KeyshredError``; anything
    else fails the test."""
    try:
        call()
    except KeyshredError:
        return False
    return True


@pytest.fixture
def ks(tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(None), embeddings=bag_of_words)
    store.subjects.register_identifiers(VICTIM, emails=[VICTIM], phones=[PHONE])
    # dave's fact is about the victim (detected) and derived from bob's note.
    note = store.memories.put("bob", ("notes",), "n", {"text": "bob's note"})
    store.memories.put("dave", NS, "f", {"text": f"her phone is {PHONE}"}, sources=[note.memory_id])
    yield store
    store.close()


def _identifier_rows(ks: Keyshred) -> list[tuple[Any, ...]]:
    with ks.catalog.read() as conn:
        return sorted(
            tuple(r)
            for r in conn.execute(
                sa.select(identifiers.c.hash, identifiers.c.subject_ref, identifiers.c.kind)
            )
        )


def _fact(ks: Keyshred) -> tuple[Any, ...]:
    m = ks.memories.get("dave", NS, "f")
    assert m is not None
    return (m.value, tuple(sorted(m.mentions)), tuple(sorted(m.sources)))


identifier_lists = st.one_of(
    st.lists(wild_text, max_size=3),
    st.lists(
        st.sampled_from(
            ["a@b.example", PHONE, "+44 20 7946 0958", "11010519491231002X", "Vera Victim"]
        ),
        max_size=3,
    ),
    anything,
)


def test_register_and_forget_identifiers_take_anything(ks: Keyshred) -> None:
    @SETTINGS
    @given(
        st.one_of(st.sampled_from(["alice", "bob"]), anything),
        identifier_lists,
        identifier_lists,
        identifier_lists,
        identifier_lists,
        st.booleans(),
    )
    def run(s: Any, e: Any, p: Any, r: Any, n: Any, forget: bool) -> None:  # noqa: PLR0917
        before = _identifier_rows(ks)
        if forget:
            _only_typed_errors(lambda: ks.subjects.forget_identifiers(s))
            return
        call = lambda: ks.subjects.register_identifiers(  # noqa: E731
            s, emails=e, phones=p, resident_ids=r, names=n
        )
        if not _only_typed_errors(call):
            assert _identifier_rows(ks) == before  # a refused call registers nothing

    run()
    # The victim's identifiers were never forgotten: a new value still finds them.
    m = ks.memories.put("erin", NS, "g", {"text": f"call {PHONE}"})
    assert ks.subject_ref(VICTIM) in m.mentions
    assert _fact(ks)[1] == (ks.subject_ref(VICTIM),)


def test_update_and_correct_take_any_mentions_and_sources(ks: Keyshred) -> None:
    mentions = st.one_of(
        st.none(), st.lists(st.sampled_from(["alice", "bob", VICTIM]), max_size=2), anything
    )
    sources = st.one_of(st.none(), st.lists(wild_text, max_size=2), anything)
    values = st.one_of(st.just({"text": "plain"}), anything)

    @SETTINGS
    @given(st.booleans(), values, mentions, sources, st.one_of(wild_text, anything))
    def run(correct: bool, v: Any, m: Any, src: Any, reason: Any) -> None:
        before = _fact(ks)
        if correct:
            call = lambda: ks.memories.correct("dave", NS, "f", v, reason=reason)  # noqa: E731
        else:
            call = lambda: ks.memories.update("dave", NS, "f", v, mentions=m, sources=src)  # noqa: E731
        if not _only_typed_errors(call):
            assert _fact(ks) == before  # refused: value and provenance as they were
        # Restore the fixture's state for the next example (a worked call changed it).
        ks.memories.update(
            "dave",
            NS,
            "f",
            before[0],
            mentions=[VICTIM],
            sources=list(before[2]),
        )
        assert _fact(ks) == before

    run()
    ks.close()
    with Keyshred.open(ks.path, embeddings=bag_of_words) as again:
        m = again.memories.get("dave", NS, "f")
        assert m is not None and m.mentions == (again.subject_ref(VICTIM),)


def _scannable(text: str) -> bool:
    # Only places inside the test's folder: no absolute path, no way up.
    return not text.startswith(("/", "\\")) and ".." not in text


def _stays_inside(value: Any) -> bool:
    """No text anywhere in ``value`` (as ``anything`` nests it, 100,000 deep at most)
    names a place outside the test's folder: an arbitrary value given as the paths
    must not make the scan read the whole machine ("/" ran past the test timeout)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, bytes):
            item = item.decode("utf-8", "replace")
        if isinstance(item, str):
            if not _scannable(item) or item.startswith("~"):
                return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return True


def test_residue_scan_takes_any_probes_and_paths(
    ks: Keyshred, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "plain.txt").write_text(f"leaked {PHONE}", encoding="utf-8")
    monkeypatch.chdir(scratch)
    paths = st.one_of(
        st.just([scratch]),
        st.just([str(ks.path / "memories")]),
        st.lists(wild_text.filter(_scannable), max_size=2),
        st.sampled_from(
            [["a\x00b"], ["x" * 5000], [("y" * 300 + "/") * 20], ["\ud800"], [b"plain.txt"]]
        ),
        anything.filter(_stays_inside),
    )
    probes = st.one_of(
        st.just([PHONE]),
        st.lists(wild_text, max_size=3),
        st.sampled_from([["ab"], "abc"]),
        anything,
    )
    before = _fact(ks)

    @SETTINGS
    @given(probes, paths)
    def run(p: Any, where: Any) -> None:
        _only_typed_errors(lambda: ks.erasure.residue_scan(p, where))

    run()
    # Nothing is found without a probe in it, and a read-only scan changed nothing.
    report = ks.erasure.residue_scan([PHONE], [scratch])
    assert not report.clean
    assert _fact(ks) == before


def test_data_key_takes_any_owners(ks: Keyshred) -> None:
    holder = ks.subject_ref("dave")
    owners = st.one_of(
        st.lists(st.sampled_from([holder, ks.subject_ref(VICTIM), "x" * 257, ""]), max_size=3),
        st.lists(wild_text, max_size=3),
        anything,
    )

    @SETTINGS
    @given(
        st.one_of(st.just(holder), wild_text, anything),
        st.one_of(st.just("default"), wild_text, anything),
        owners,
        st.booleans(),
    )
    def run(ref: Any, scope: Any, o: Any, create: bool) -> None:
        counts = ks.keyring.store.counts()
        if not _only_typed_errors(lambda: ks.keyring.data_key(ref, scope, owners=o, create=create)):
            assert ks.keyring.store.counts() == counts  # a refused call makes no key

    run()
    assert _fact(ks)[0] == {"text": f"her phone is {PHONE}"}


def _cli(argv: list[str]) -> int:
    """The command line in this process, its standard error as an interpreter's
    (``backslashreplace``: an argument that is no valid Unicode, such as an option
    ``-\\udcff`` a shell passed from undecodable bytes, is echoed escaped;
    ``capsys``'s capture is strict and raised instead)."""
    from keyshred import cli

    old, stderr = sys.argv, sys.stderr
    sys.argv = ["keyshred", *argv]
    errors = stderr.errors if isinstance(stderr, io.TextIOWrapper) else None
    if isinstance(stderr, io.TextIOWrapper):
        stderr.reconfigure(errors="backslashreplace")
    try:
        cli.main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    finally:
        sys.argv = old
        if isinstance(stderr, io.TextIOWrapper):
            stderr.reconfigure(errors=errors)
    return 0


def test_verify_residue_cli_takes_any_arguments(
    ks: Keyshred,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "probes.txt").write_bytes(b"\xff\xfe not utf-8")
    monkeypatch.chdir(scratch)
    data = str(ks.path)
    args = st.lists(
        st.one_of(
            st.sampled_from(
                [
                    "--probe",
                    "--probes-file",
                    "probes.txt",
                    "--path",
                    data,
                    "--json",
                    PHONE,
                    ".",
                    "-p",
                    "/nonexistent",
                ]
            ),
            wild_text.filter(lambda t: _scannable(t) and "\x00" not in t),
        ),
        max_size=6,
    )

    @SETTINGS
    @given(args)
    def run(argv: list[str]) -> None:
        code = _cli(["verify", "residue", *argv])
        assert code in {0, 1, 2}
        assert "Traceback" not in capsys.readouterr().err

    run()


def test_a_fifo_in_a_scanned_folder_is_skipped(ks: Keyshred, tmp_path: Path) -> None:
    """A named pipe (or any file that is not a regular one) in a scanned folder is
    not opened: opening a FIFO for reading waits for a writer, forever."""
    folder = tmp_path / "scan"
    folder.mkdir()
    (folder / "a.txt").write_text(f"leaked {PHONE}", encoding="utf-8")
    fifo = folder / "pipe"
    os.mkfifo(fifo)
    result: list[Any] = []
    worker = threading.Thread(
        target=lambda: result.append(ks.erasure.residue_scan([PHONE], [folder])), daemon=True
    )
    worker.start()
    worker.join(60)
    if worker.is_alive():
        # Release every blocked open (as a writer that leaves at once) so the
        # thread ends, then fail.
        while worker.is_alive():
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            worker.join(0.1)
        pytest.fail("the scan blocked opening a FIFO")
    (report,) = result
    assert not report.clean and report.files_scanned == 1
