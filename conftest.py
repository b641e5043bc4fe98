"""Root conftest of the repository: settings for the plugin's own tests and the reference's
self-tests (not shipped: the installed conformance suites carry their own settings)."""

pytest_plugins = ["pytester"]

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # pragma: no cover - hypothesis is a dependency
    pass
else:
    settings.register_profile(
        "ci",
        deadline=None,
        max_examples=25,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    settings.register_profile("dev", deadline=None, max_examples=10)
    settings.load_profile("ci")
