"""The ZeroMQ planes: the HELLO handshake and stats request (:mod:`.handshake`), batch frames of
packets (:mod:`.frames`) and the reliable data plane (:mod:`.plane`, :class:`~.plane.ZmqPlane`)."""
