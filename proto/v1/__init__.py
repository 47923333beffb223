"""Generated gRPC code for rollwire.v1; do not edit. See rollwire.services.app.protogen."""
