"""Issue 19 as a new user meets it: what the README tour and the CLI table promise."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from keyshred import Keyshred
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

VICTIM = "victim@example.com"
PHONE = "13812345678"


def test_update_and_correct_keep_a_detected_mention_counted_as_detected(tmp_path: Path) -> None:
    """A mention found from a registered identifier stays "detected" when ``update``
    or ``correct`` carries it over; it was re-recorded as "declared", so
    ``mention_counts`` (what the drill reports as found) dropped to 0."""
    with Keyshred.init(tmp_path / "d", make_config(None), embeddings=bag_of_words) as ks:
        ks.subjects.register_identifiers(VICTIM, phones=[PHONE])
        m = ks.memories.put("dave", ("facts",), "f", {"text": f"her phone is {PHONE}"})
        assert m.mentions == (ks.subject_ref(VICTIM),)
        assert ks.catalog.mention_counts() == {"declared": 0, "detected": 1}
        ks.memories.update("dave", ("facts",), "f", {"text": "she moved"})
        assert ks.catalog.mention_counts() == {"declared": 0, "detected": 1}
        ks.memories.correct("dave", ("facts",), "f", {"text": "she moved again"}, reason="fix")
        # The current value and its history version both carry the found mention.
        assert ks.catalog.mention_counts() == {"declared": 0, "detected": 2}
        # Replacing the mentions on purpose makes them declared.
        ks.memories.update("dave", ("facts",), "f", {"text": "x"}, mentions=[VICTIM])
        assert ks.catalog.mention_counts() == {"declared": 1, "detected": 1}


def test_backup_list_names_the_kek_lineage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A generation's epoch is an archive epoch (its own), not a live one: the table
    said only "KEK epoch 2" while ``keys status`` listed live epoch 1."""
    from keyshred import cli

    data = tmp_path / "d"
    with Keyshred.init(data, make_config(None), embeddings=bag_of_words) as ks:
        ks.memories.put("dave", ("facts",), "f", {"text": "x"})
        gen = ks.backup.create()
    monkeypatch.setattr(sys, "argv", ["keyshred", "backup", "list", "--path", str(data)])
    with pytest.raises(SystemExit) as done:
        cli.main()
    assert done.value.code in {0, None}
    text = capsys.readouterr().out
    assert "archive" in text, text
    assert gen.generation[:8] in text


def test_an_archive_kek_that_is_the_live_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kek.archive_local_path`` set to the live key file made the backup's archive
    epoch a live epoch of the same file (``keys status``: epoch 2, live [1, 2]): the
    archive schedule would then destroy live epochs. Refused with ``ConfigError``,
    nothing written; the same for Transit and KMS names."""
    from keyshred._backends import make_kek
    from keyshred.config import AwsSettings, KekSettings, VaultSettings
    from keyshred.errors import ConfigError

    data = tmp_path / "d"
    config = make_config(None)
    shared = config.model_copy(
        update={"kek": KekSettings(archive_local_path=str(data / "keys" / "kek.local.json"))}
    )
    with Keyshred.init(data, shared, embeddings=bag_of_words) as ks:
        ks.memories.put("dave", ("facts",), "f", {"text": "x"})
        with pytest.raises(ConfigError, match="archive KEK"):
            ks.backup.create()
        assert [e.epoch for e in ks.keyring.kek.epochs()] == [1]
        m = ks.memories.get("dave", ("facts",), "f")
        assert m is not None and m.value == {"text": "x"}
        assert ks.backup.generations() == []
    monkeypatch.setenv("KEYSHRED_VAULT_TOKEN", "not-used")
    for kek in (
        KekSettings(provider="vault", vault=VaultSettings(key="k", archive_key="k")),
        KekSettings(
            provider="aws", aws=AwsSettings(alias_prefix="alias/a", archive_alias_prefix="alias/a/")
        ),
        KekSettings(
            provider="aws", aws=AwsSettings(alias_prefix="alias/a", archive_alias_prefix="alias")
        ),
    ):
        with pytest.raises(ConfigError, match="archive KEK"):
            make_kek(config.model_copy(update={"kek": kek}), data, create=True, archive=True)


def test_a_one_word_name_is_refused_so_its_erasure_cannot_take_others_data(
    tmp_path: Path,
) -> None:
    """Registering the name "May" made bob's "I may go to Oslo" mention may, so
    erasing may dropped bob's own note. Names need two words (two ideographs)."""
    from keyshred.errors import InvalidInput

    with Keyshred.init(tmp_path / "d", make_config(None), embeddings=bag_of_words) as ks:
        with pytest.raises(InvalidInput, match="2-4 words") as refused:
            ks.subjects.register_identifiers("may@example.com", names=["May"])
        assert "May" not in str(refused.value)
        with pytest.raises(InvalidInput):
            ks.subjects.register_identifiers("wei@example.com", names=["伟"])
        assert ks.subjects.register_identifiers("wei@example.com", names=["张伟"]) == 1
        assert ks.subjects.register_identifiers("may@example.com", names=["May Lee"]) == 1
        note = ks.memories.put("bob", ("notes",), "n1", {"text": "I may go to Oslo"})
        assert note.mentions == ()
        ks.erase("may@example.com", requested_by="dpo", reason="test")
        kept = ks.memories.get("bob", ("notes",), "n1")
        assert kept is not None and kept.value == {"text": "I may go to Oslo"}


def test_a_folder_the_residue_scan_cannot_list_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subfolder that cannot be listed (no permission: a non-root user) was skipped
    in silence, and the scan said "no probe found" over less than it was given."""
    import os

    with Keyshred.init(tmp_path / "d", make_config(None), embeddings=bag_of_words) as ks:
        folder = tmp_path / "scan"
        (folder / "closed").mkdir(parents=True)
        (folder / "closed" / "a.txt").write_text(f"leaked {PHONE}", encoding="utf-8")
        real = os.scandir

        def scandir(path: Any = ".") -> Any:
            # What a non-root user meets in a folder of mode 000 (tests run as root).
            if Path(path).name == "closed":
                raise PermissionError(13, "Permission denied")
            return real(path)

        monkeypatch.setattr(os, "scandir", scandir)
        report = ks.erasure.residue_scan([PHONE], [folder])
        assert report.unreadable == {"folder": 1}
        assert report.clean  # nothing readable held the probe; the count says why
