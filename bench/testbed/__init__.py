"""An emulated leaf-spine network of Linux network namespaces: build it (:mod:`.netns`), shape
and prioritise it (:mod:`.tc`), load it (:mod:`.crosstraffic`, :mod:`.trafficgen`), impair it
(:mod:`.impair`) and check it (:mod:`.selfcheck`). Kept import-free: its processes start fast."""
