"""Sessions on disk: save, load, list, delete, export, prune. Imports no Textual.

One folder per session under :func:`kvchat.locations.sessions_dir`:

- ``session.json``: the transcript and everything needed to resume it
  (settings, model id and fingerprint, cache kind, ledger, per-turn stats,
  archived turns, kvchat version, times, name);
- ``cache.safetensors``: the prompt cache, written by mlx-lm's
  ``save_prompt_cache`` (no pickle), with metadata naming the kvchat version,
  model fingerprint, cache kind and the ledger it holds;
- ``checkpoints.safetensors`` (only for models with sliding-window or recurrent
  layers): the session's checkpoints, checksum and positions in ``session.json``;
  one that cannot be used is left out with a notice, the cache still resumes.

Every write is atomic (:func:`kvchat.atomic.write_atomic`: temporary file in the
same folder, fsync, rename, fsync of the folder), the cache first and ``session.json`` last. The JSON
records the cache file's sha256 and the ledger's hash, so a load can tell
whether the pair belongs together. Anything wrong with the cache (missing,
damaged, another model or kvchat version, a ledger that does not match) is
never fatal: the transcript loads and the cache is rebuilt from it, with a
one-sentence notice. Only a damaged ``session.json`` is an error, and nothing
is ever deleted or overwritten because of one.

Modules: ``base`` (names, constants, result types), ``files`` (files opened
only when they are what they claim to be), ``lock`` (the per-session lock),
``session_file`` (reading ``session.json``), ``generations`` (a save
refused when another process saved first, and keeping both), ``lease`` (which
processes have a session open), ``cache_file`` (reading the
cache), ``core`` (save and load), ``manage`` (list, delete, prune), ``exports``
(export, import an export), ``search_index`` (the full-text index of every transcript)
and ``search`` (its queries).
"""

from kvchat.atomic import TMP_PREFIX
from kvchat.store.base import (
    CACHE_FILE,
    CACHE_SUM_FILE,
    CHECKPOINTS_FILE,
    FORMAT,
    LOCK_TIMEOUT_S,
    NAME_RE,
    SESSION_FILE,
    Generation,
    Loaded,
    SessionSummary,
    StoreError,
    check_name,
    exists,
    ledger_hash,
    session_dir,
)
from kvchat.store.exports import (
    FORMATS,
    export,
    export_session,
    import_session,
    write_export,
)
from kvchat.store.generations import SessionChanged, generation_of, save_as_branch
from kvchat.store.lease import hold_open, let_go, open_elsewhere
from kvchat.store.lock import session_lock
from kvchat.store.manage import (
    Pruned,
    delete,
    list_sessions,
    parse_duration,
    prune,
    summary,
)
from kvchat.store.save_load import Progress, load, save, set_aside
from kvchat.store.search import Found, Hit, matching_sessions, search_sessions
from kvchat.store.search_index import reindex
from kvchat.store.session_file import read, read_with_generation

__all__ = [
    "CACHE_FILE",
    "FORMAT",
    "FORMATS",
    "CACHE_SUM_FILE",
    "CHECKPOINTS_FILE",
    "LOCK_TIMEOUT_S",
    "NAME_RE",
    "SESSION_FILE",
    "TMP_PREFIX",
    "Found",
    "Generation",
    "Hit",
    "Loaded",
    "Progress",
    "Pruned",
    "SessionChanged",
    "SessionSummary",
    "StoreError",
    "check_name",
    "delete",
    "exists",
    "generation_of",
    "hold_open",
    "let_go",
    "export",
    "export_session",
    "import_session",
    "ledger_hash",
    "list_sessions",
    "load",
    "matching_sessions",
    "open_elsewhere",
    "parse_duration",
    "prune",
    "read",
    "read_with_generation",
    "reindex",
    "save",
    "save_as_branch",
    "search_sessions",
    "session_dir",
    "session_lock",
    "set_aside",
    "summary",
    "write_export",
]
