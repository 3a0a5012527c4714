import sys

from planner.cli import main

COMMANDS = {
    "memory": "planner.commands.memory",
    "plan": "planner.commands.plan",
    "evaluate": "planner.commands.evaluate",
    "schedule": "planner.commands.schedule",
    "geo": "planner.commands.geo",
}

if __name__ == "__main__":
    sys.exit(main("python -m planner", COMMANDS))
