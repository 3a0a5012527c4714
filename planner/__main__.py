import sys

from contracts.cli import main

COMMANDS = {
    "memory": "planner.core.memory_command",
    "plan": "planner.hetero.plan_command",
    "evaluate": "planner.hetero.evaluate_command",
    "schedule": "planner.schedule.command",
    "geo": "planner.geo.command",
}

if __name__ == "__main__":
    sys.exit(main("python -m planner", COMMANDS))
