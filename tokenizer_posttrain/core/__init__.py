"""Layer 0, the foundation every other layer may use: the error types whose messages reach the user
as they are, and writing files so that a kill never leaves half a file under the final name.
It imports nothing else of the package."""
