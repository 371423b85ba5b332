from prunelab.cli import run

run()
