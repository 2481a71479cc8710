from dfcache.cli import _entry

_entry()
