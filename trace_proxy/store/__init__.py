"""The jsonl store on disk: what its names are, where a record goes, how it is read back."""
