"""Command-line tools of the product: doctor (and the link, machine and speed models it uses), client."""
