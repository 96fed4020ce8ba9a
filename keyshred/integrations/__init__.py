"""Integrations with agent frameworks: ``keyshred.integrations.langgraph``
(``KeyshredStore``, ``KeyshredSaver``; ``pip install 'keyshred[langgraph]'``)."""
