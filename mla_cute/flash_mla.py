"""FlashMLA's Python interface served by mla-cute, for engines that import FlashMLA as a module::

    import mla_cute.flash_mla as flash_mla   # instead of: import flash_mla

The names and their arguments are FlashMLA's (its Hopper build's: ``use_legacy``, ``kv_format``,
``return_log2_lse`` and the rest, in its positional order); see ``mla_cute.api`` for what each takes here."""

from .api import (FlashMLASchedMeta, flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_decoding_metadata,
                  get_mla_metadata)

__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "get_mla_decoding_metadata", "flash_mla_with_kvcache",
           "flash_mla_sparse_fwd"]
