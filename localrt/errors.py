"""Errors a user can cause. The CLI prints them as one line; the API maps them to a status."""

from __future__ import annotations


class LocalrtError(Exception):
    """A user-facing error: the message is complete and shown as is, without a traceback."""

    status = 400  # HTTP status the API answers with


class InvalidName(LocalrtError):
    pass


class ModelNotFound(LocalrtError):
    status = 404


class DigestMismatch(LocalrtError):
    pass


class PullError(LocalrtError):
    status = 502


class ServerBusy(LocalrtError):
    status = 503


class OptionError(LocalrtError):
    pass


class BackendUnavailable(LocalrtError):
    status = 501


class ClientClosed(LocalrtError):
    """The client hung up before its answer was ready; the status is nginx's 499, which nobody reads."""

    status = 499


class InsufficientMemory(LocalrtError):
    """A model that does not fit the memory left, even fitted down; Ollama answers this with a 500."""

    status = 500


class EngineFailure(LocalrtError):
    """The engine could not run a request for a reason that is not the request's own (a decode that
    failed, an engine thread that stopped on an error): a 500 naming it. The model serves the next request."""

    status = 500
