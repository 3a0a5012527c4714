import sys

from contracts.cli import main

COMMANDS = {
    "memory": "profiler.commands.memory",
    "inventory": "profiler.commands.inventory",
    "bench": "profiler.commands.bench",
    "profile": "profiler.commands.profile",
    "import": "profiler.commands.import_profiles",
}

if __name__ == "__main__":
    sys.exit(main("python -m profiler", COMMANDS))
