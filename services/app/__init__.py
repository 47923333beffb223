"""The application floor: the CLI, the local launcher and protogen, which know every service."""
