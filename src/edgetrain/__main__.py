from edgetrain.cli import entry

entry()
