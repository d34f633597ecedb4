"""A run's configuration: the dataclasses and their YAML form (`schema`), the checks that refuse bad values with the
key and the fix (`checks`), and reading YAML and `--section.key=value` overrides (`loading`)."""
