"""gradlane bench: trace replay, the network simulator (netsim), testbed drivers and reports."""
