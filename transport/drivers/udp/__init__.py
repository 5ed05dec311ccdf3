"""The UDP data plane: sockets on an asyncio/uvloop loop (:mod:`.sockets`), batched
``sendmmsg``/``recvmmsg`` with GSO/GRO (:mod:`.mmsg`) and the plane that drives a rank's
all-reduce on its own thread (:mod:`.plane`, :class:`~.plane.UdpPlane`)."""
