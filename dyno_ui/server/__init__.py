"""The HTTP server: `run.run(options)` serves the app `app.create_app` builds, one subpackage per API.

Deliberately empty: the APIs import `errors` and `streaming` from here without pulling in the app.
"""
