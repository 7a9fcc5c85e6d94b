"""Where kvchat keeps its files: data, config, cache and themes.

Each directory comes from platformdirs and can be overridden by an environment
variable (tests and users with unusual layouts rely on that). Directories that
hold user data are created on first use, readable by the user only.
"""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir, user_config_dir, user_data_dir

APP = "kvchat"


def _private_dir(path: Path) -> Path:
    """Create ``path`` and whichever of its parents are missing, each readable by the
    user only whatever the umask; folders that exist are left as they are."""
    for folder in [*reversed(path.parents), path]:
        if os.path.lexists(folder):
            continue
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile by another process
            continue
        os.chmod(folder, 0o700)
    return path


def _from_env(variable: str, default: str) -> Path:
    return Path(os.environ.get(variable) or default).expanduser()


def data_dir() -> Path:
    """Saved sessions and other user data (``KVCHAT_HOME`` overrides)."""
    return _private_dir(_from_env("KVCHAT_HOME", user_data_dir(APP)))


def sessions_dir() -> Path:
    """One folder per saved session."""
    return _private_dir(data_dir() / "sessions")


def config_dir() -> Path:
    """Settings and user themes (``KVCHAT_CONFIG_DIR`` overrides)."""
    return _private_dir(_from_env("KVCHAT_CONFIG_DIR", user_config_dir(APP)))


def config_file() -> Path:
    """The TOML settings file; it may not exist."""
    return config_dir() / "config.toml"


def cache_dir() -> Path:
    """Rebuildable files such as the demo models (``KVCHAT_CACHE_DIR`` overrides)."""
    return _private_dir(_from_env("KVCHAT_CACHE_DIR", user_cache_dir(APP)))


def models_dir() -> Path:
    """Built demo models, one folder each."""
    return _private_dir(cache_dir() / "models")


def user_themes_dir() -> Path:
    """Theme files the user adds; it may not exist."""
    return config_dir() / "themes"


def builtin_themes_dir() -> Path:
    """Themes shipped with kvchat.

    A wheel carries them inside the package (``kvchat/themes``, see
    pyproject.toml); a source checkout or editable install has them in the
    top-level ``themes/`` folder next to the package.
    """
    package = Path(__file__).resolve().parent
    installed = package / "themes"
    return installed if installed.is_dir() else package.parent / "themes"


def drafts_dir() -> Path:
    """The message each session was sending when kvchat last stopped, one file each."""
    return _private_dir(data_dir() / "drafts")
