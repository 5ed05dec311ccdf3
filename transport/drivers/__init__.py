"""I/O drivers that run the sans-I/O core over real sockets: the UDP plane (:mod:`.udp`), the
ZeroMQ plane (:mod:`.zmq`), the Futures at their edge (:mod:`.futures`), static peer tables
(:mod:`.peers`), the loop waker and the kernel warm-up."""
