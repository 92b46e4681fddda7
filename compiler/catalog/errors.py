"""The one error the catalog raises."""


class CatalogError(LookupError):
    """A model or GPU the catalog cannot provide; the message names close catalog entries."""
