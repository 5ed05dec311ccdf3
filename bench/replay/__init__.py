"""Trace replay: record DDP bucket traces (:mod:`.record`), synthesise them (:mod:`.synth`) and
replay them over gloo and gradlane (:mod:`.run`, :mod:`.rank`, :mod:`.report`)."""
