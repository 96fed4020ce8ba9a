"""OpenTelemetry spans, emitted only when the application configured a tracer provider.

keyshred never imports OpenTelemetry itself (``keyshred[otel]`` installs the API for
applications that want it). An application that set a tracer provider has imported
``opentelemetry.trace``, so whether tracing is on is one ``sys.modules`` lookup and,
when it is there, one check that the global provider is not the API's placeholder
(``ProxyTracerProvider``, ``NoOpTracerProvider``). Without it every span here is a
shared no-op object: no import, no allocation, no error.

Spans (tracer ``keyshred``):

- ``keyshred.erase`` (``Keyshred.erase``), ``keyshred.erasure.run`` (one run of a
  request) and ``keyshred.erasure.<step>`` for every step it runs, with the
  attributes ``keyshred.request_id``, ``keyshred.kind``, ``keyshred.step``,
  ``keyshred.state`` (the state the step started from; on the run, the state it
  ended in);
- ``keyshred.memories.<op>`` around the memory store's public operations and
  ``keyshred.kek.<op>`` around KEK provider calls (``traced_class``, ``trace_instance``).

No personal data in any span: attributes are request ids, state, step and kind
names; never a subject id, not even a subject_ref (a request id leads an operator
to the request, and from there to its receipt). A failure sets the status to
``ERROR`` described by the exception's class name and ``error.type`` to its
qualified name (the semantic conventions' attribute); the message is never recorded
(no ``record_exception``: a message or a traceback's locals could carry a value).
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

__all__ = ["Span", "enabled", "span", "trace_instance", "traced_class"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

TRACER_NAME = "keyshred"
Attributes = Mapping[str, str | int | bool]

# (provider, tracer): a tracer is built once per provider the application sets.
_tracer_of: list[Any] = [None, None]
_UNKNOWN = object()
_PROVIDER_FROM_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ


def _tracer() -> Any:
    """The tracer to use, or ``None`` while no tracer provider is configured."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None  # nothing imported OpenTelemetry: nothing configured it
    # The global as set_tracer_provider stored it: reading it costs a lookup, where
    # get_tracer_provider() looks up an environment variable on every call (8 µs
    # under load) while nothing is set. Providers named by that variable, and an
    # API without the global, go through get_tracer_provider().
    provider: Any = getattr(trace, "_TRACER_PROVIDER", _UNKNOWN)
    if provider is None and not _PROVIDER_FROM_ENV:
        return None
    if provider is None or provider is _UNKNOWN:
        provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    cached = _tracer_of
    if cached[0] is not provider:
        cached[1] = provider.get_tracer(TRACER_NAME)
        cached[0] = provider
    return cached[1]


def enabled() -> bool:
    """Whether the application configured a tracer provider (spans are recorded)."""
    return _tracer() is not None


class Span:
    """A span as keyshred code sees it: ``set`` an attribute, ``fail`` with an error.
    The no-op one (``_NOOP``) is what every call gets while tracing is off."""

    __slots__ = ("_cm", "_span")

    def __init__(self, cm: Any = None) -> None:
        self._cm = cm
        self._span: Any = None

    def __enter__(self) -> Span:
        if self._cm is not None:
            self._span = self._cm.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._cm is None:
            return
        if exc is not None:
            self.fail(exc)
        # The OpenTelemetry context manager ends the span and restores the context;
        # it records nothing of the exception (record_exception=False).
        self._cm.__exit__(exc_type, exc, tb)

    def set(self, key: str, value: str | int | bool) -> None:
        if self._span is not None:
            self._span.set_attribute(key, _plain(value))

    def fail(self, exc: BaseException) -> None:
        """Mark the span failed by ``exc``'s class, never its message."""
        if self._span is None:
            return
        trace = sys.modules["opentelemetry.trace"]
        cls = type(exc)
        self._span.set_attribute("error.type", f"{cls.__module__}.{cls.__qualname__}")
        self._span.set_status(trace.Status(trace.StatusCode.ERROR, cls.__name__))


_NOOP = Span()
# What a string attribute may be: plain metadata, the alphabet request ids are
# checked against (``keyshred.erasure.requests.safe``). Anything else (a value
# that reached an attribute by mistake, a request id nobody checked yet) is
# recorded as "invalid", never as itself.
_PLAIN = re.compile(r"[A-Za-z0-9 ._:@/+()#,-]{1,128}")


def _plain(value: str | int | bool) -> str | int | bool:
    if isinstance(value, str) and not _PLAIN.fullmatch(value):
        return "invalid"
    return value


def span(name: str, attributes: Attributes | None = None) -> Span:
    """A context manager for a span named ``name`` (a no-op while tracing is off);
    ``attributes`` must hold names and ids only (see the module docstring)."""
    tracer = _tracer()
    if tracer is None:
        return _NOOP
    return _start(tracer, name, attributes)


def _start(tracer: Any, name: str, attributes: Attributes | None) -> Span:
    return Span(
        tracer.start_as_current_span(
            name,
            attributes={k: _plain(v) for k, v in attributes.items()} if attributes else None,
            # Both would write the exception's message into the span.
            record_exception=False,
            set_status_on_exception=False,
        )
    )


def _traced(fn: F, name: str) -> F:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        tracer = _tracer()
        if tracer is None:  # the whole cost while tracing is off
            return fn(*args, **kwargs)
        with _start(tracer, name, None):
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


# (class, prefix, methods) -> its traced subclass: built once per process.
_subclasses: dict[tuple[type[Any], str, tuple[str, ...]], type[Any]] = {}
_MARK = "_keyshred_traced"


def _subclass(cls: type[Any], prefix: str, methods: tuple[str, ...]) -> type[Any]:
    if _MARK in vars(cls):
        return cls  # traced already: one span per call, not two
    known = _subclasses.get((cls, prefix, methods))
    if known is not None:
        return known
    namespace: dict[str, Any] = {
        m: _traced(getattr(cls, m), f"keyshred.{prefix}.{m}") for m in methods if hasattr(cls, m)
    }
    # No new slots or __dict__: the layout stays the base's, so an instance's class
    # can be swapped (trace_instance).
    namespace["__slots__"] = ()
    namespace["__module__"] = cls.__module__
    namespace["__qualname__"] = cls.__qualname__
    namespace[_MARK] = True
    meta: Any = type(cls)  # the base's metaclass (ABCMeta for the KEK providers)
    sub: type[Any] = meta(cls.__name__, (cls,), namespace)
    _subclasses[(cls, prefix, methods)] = sub
    return sub


def traced_class(cls: type[T], prefix: str, methods: Sequence[str]) -> type[T]:
    """A subclass of ``cls`` whose ``methods`` run inside ``keyshred.<prefix>.<method>``
    spans (one per process and arguments). Methods on the class, not wrappers around
    instances: ``isinstance`` holds, and ``keyshred._handle.Guarded`` caches them."""
    return cast("type[T]", _subclass(cls, prefix, tuple(methods)))


def trace_instance(obj: T, prefix: str, methods: Sequence[str]) -> T:
    """``obj`` itself, its class swapped for ``traced_class(type(obj), ...)``: for an
    object built elsewhere (a KEK provider), without a proxy in front of it."""
    obj.__class__ = traced_class(type(obj), prefix, methods)
    return obj
