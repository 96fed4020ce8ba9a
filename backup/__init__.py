"""``keyshred.backup``: snapshots of ciphertext partitions, restore with tombstone replay.

Not built yet: arrives with issue #7. Nothing in this package is usable today.
"""
