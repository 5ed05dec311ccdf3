"""The main job, ``gradlane demo``: real DDP training, DDP's default gloo hook against
gradlane's, on loopback, the emulated testbed or the simulator."""
