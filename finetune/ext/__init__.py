"""The extensions: each module adds one optional capability to the core (finetune/), which never imports them.
recipes.py turns a config into what a run passes to the core; commands.py holds the extensions' commands."""
