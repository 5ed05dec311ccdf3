"""The ``gradlane`` command line: the entry point (:mod:`.main`) and the ``daemon`` and ``stats``
subcommands."""
