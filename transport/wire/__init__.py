"""What travels on the wire: the 48-byte packet header (:mod:`.header`) and the integrity tags
(:mod:`.tag`). Pure encode/decode; no I/O."""
