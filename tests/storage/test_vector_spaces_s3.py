"""Embedding spaces on the shared layout (partitions on moto's S3 over HTTP): a
subject's vectors of two spaces and two widths are rows of the catalog, never
objects of the bucket, and its erasure leaves no row of either and no object under
the vectors prefix (the verification lists the bucket)."""

from __future__ import annotations

from keyshred import Keyshred
from keyshred.storage.embeddings import Embedder
from keyshred.storage.erasable import ErasureTarget
from keyshred.storage.vectors import space_tag
from tests.servers import Server
from tests.storage.test_s3_partitions import bucket, ks, versions  # noqa: F401 - fixtures
from tests.storage.test_vectors import hashed, vector_rows

NS = ("notes",)


def test_two_spaces_on_the_bucket_are_erased_together(
    ks: Keyshred,  # noqa: F811
    bucket: str,  # noqa: F811
    moto: Server,
) -> None:
    other = Embedder(hashed(16), dims=16, space="hashed-16")
    for i in range(3):
        ks.memories.put("carol", NS, f"h{i}", {"text": f"carol handle {i}"}, index=True)
        ks.memories.put(
            "carol", NS, f"o{i}", {"text": f"carol other {i}"}, index=True, embedder=other
        )
    ks.memories.put("dave", NS, "k", {"text": "dave other"}, index=True, embedder=other)
    ref = ks.subject_ref("carol")
    ks.vectors.evict(ref)  # both widths read back from the bucket
    assert ks.vectors.spaces(ref) == {"", space_tag("hashed-16", 16)}
    assert ks.vectors.count(ref) == 6
    hits = ks.memories.search("carol", (), query="other 1", embedder=other, limit=1)
    assert [h.key for h in hits] == ["o1"]
    # The search in the other space embedded the handle's three memories there too.
    assert len(vector_rows(ks, ref)) == 9
    assert versions(moto, bucket, "vectors/") == []  # no object per subject
    req = ks.erase("carol", requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    assert versions(moto, bucket, f"vectors/{ref}.lance") == []
    assert vector_rows(ks, ref) == []
    checks = ks.vectors.verify(ErasureTarget(ref))
    assert checks and all(c.passed for c in checks)
    kept = ks.memories.search("dave", (), query="other", embedder=other, limit=1)
    assert [h.key for h in kept] == ["k"]
