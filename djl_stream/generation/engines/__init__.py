"""Stream engines. Each module here registers one engine in :class:`StreamingUtils`."""
