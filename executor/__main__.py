import sys

from contracts.cli import main

COMMANDS = {
    "launch": "executor.commands.launch",
    "export": "executor.commands.export",
    "metrics": "executor.commands.metrics",
    "stop": "executor.commands.stop",
    "submit": "executor.commands.submit",
    "queue": "executor.commands.queue",
    "orchestrate": "executor.commands.orchestrate",
    "db": "executor.commands.db",
}

if __name__ == "__main__":
    sys.exit(main("python -m executor", COMMANDS))
