"""``--sync`` specs and what composes with what: parsed in ``edgetrain.spec`` (torch-free).

Kept as an import path for the callers of these names.
"""
from edgetrain.spec import SYNC_MODES as MODES
from edgetrain.spec import SyncSpec, check_compatible, parse_sync

__all__ = ["MODES", "SyncSpec", "check_compatible", "parse_sync"]
