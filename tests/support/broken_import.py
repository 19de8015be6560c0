"""A task module that cannot be imported: it needs a package this environment does not have."""

import sensor_toolkit_not_installed  # noqa: F401
