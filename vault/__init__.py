"""``keyshred.vault``: the tokenization vault.

Not built yet: detection, purpose-bound expiring tokens and the log/prompt
sanitizers arrive with issue #6. Nothing in this package is usable today.
"""
