"""What a diagnosis uses: the first-non-finite locator, bisection, the diagnosis, signal propagation, the init fingerprint."""
