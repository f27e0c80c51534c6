"""Interrupting a conversion the hard way, to test that it resumes."""

# `python -c KILL_IN_SECOND_SHARD colibri-args...`: runs `colibri` and dies like SIGKILL
# (exit 137, no cleanup) once the first shard is finished and the second begun.
KILL_IN_SECOND_SHARD = """
import os, sys
from colibrid.convert import writer
count = {"shards": 0}
orig_finish, orig_write = writer.ShardWriter.finish, writer.ShardWriter.write
def finish(self):
    orig_finish(self)
    count["shards"] += 1
def write(self, name, chunk):
    if count["shards"] >= 1 and self.written > 1000:
        os._exit(137)  # like SIGKILL: no cleanup, a partial second shard stays behind
    orig_write(self, name, chunk)
writer.ShardWriter.finish, writer.ShardWriter.write = finish, write
from colibri_cli.main import main
sys.exit(main(sys.argv[1:]))
"""
