"""Layer 0, the foundation every other layer may use: the error types whose messages reach the user
as they are, writing files so that a kill never leaves half a file under the final name, and reading files
that may come from anywhere without running code planted in them (:mod:`.untrusted`).
It imports nothing else of the package."""
