"""Key/value memory: the per-sequence cache within a pool budget (:mod:`.cache`), KV state as a
verified object with its file/stream format (:mod:`.state`), and the on-disk cache (:mod:`.disk`)."""
