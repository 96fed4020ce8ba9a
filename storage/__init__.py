"""``keyshred.storage``: the catalog, memory and vector partitions, checkpoints.

Not built yet: the catalog (asset index, consent, subject guard), the encrypted
Parquet memory partitions, the LanceDB vector partitions and checkpoints arrive with
issue #3 and the issues after it. Nothing in this package is usable today.
"""
