"""The node's actors: one long-lived Trio task per concern, one module each."""
